"""Decode attention over the paged cache reads each request's own blocks: the same numbers as attending to
that request's keys and values laid out contiguously."""

import torch
import torch.nn.functional as F

from ringsched.comm.messages import BatchPlan, PlanEntry
from ringsched.kv_cache import BlockTable
from ringsched.models.attention import paged_attention
from ringsched.scheduler.batch_builder import build_forward_batch


def test_paged_decode_matches_contiguous_attention():
    torch.manual_seed(0)
    heads, kv_heads, d, bs = 6, 2, 8, 4
    blocks = BlockTable(64, bs)
    lengths = {"a": 13, "b": 5, "c": 9, "d": 16, "e": 1}
    # Grow the requests in turns, so each one's blocks are scattered through the pool.
    for step in range(1, 17):
        for rid, n in lengths.items():
            blocks.ensure(rid, min(step, n))
    k_cache = torch.randn(64 * bs, kv_heads, d)
    v_cache = torch.randn(64 * bs, kv_heads, d)
    entries = [PlanEntry(rid, n - 1, [7], samples=True) for rid, n in lengths.items()]
    batch, _ = build_forward_batch(BatchPlan(slot=0, seq=0, entries=entries), blocks, torch.device("cpu"))
    assert len(batch.decodes) > 1  # the lengths fall in more than one group
    t = len(entries)
    q, k, v = torch.randn(t, heads, d), torch.randn(t, kv_heads, d), torch.randn(t, kv_heads, d)
    out = paged_attention(q, k, v, batch, k_cache, v_cache, scale=d**-0.5)
    for row, (rid, n) in enumerate(lengths.items()):
        slots = blocks.slots(rid, 0, n)
        kr, vr = k_cache[slots].transpose(0, 1), v_cache[slots].transpose(0, 1)  # new K/V already written
        ref = F.scaled_dot_product_attention(q[row].unsqueeze(1), kr, vr, scale=d**-0.5, enable_gqa=True)
        torch.testing.assert_close(out[row], ref.squeeze(1), rtol=1e-5, atol=1e-5)


def test_cpu_decode_groups_are_capped_and_cover_every_row():
    from ringsched.scheduler.batch_builder import CPU_GROUP_ROWS

    blocks = BlockTable(256, 4)
    n = CPU_GROUP_ROWS + 8
    for i in range(n):
        blocks.ensure(f"r{i}", 10)
    entries = [PlanEntry(f"r{i}", 9, [1], samples=True) for i in range(n)]
    batch, _ = build_forward_batch(BatchPlan(slot=0, seq=0, entries=entries), blocks, torch.device("cpu"))
    assert [len(g.rows) for g in batch.decodes] == [CPU_GROUP_ROWS, 8]
    assert sorted(torch.cat([g.rows for g in batch.decodes]).tolist()) == list(range(n))
