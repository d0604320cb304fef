"""Decode attention over the paged cache reads each request's own blocks: the same numbers as attending to
that request's keys and values laid out contiguously."""

import torch
import torch.nn.functional as F

from ringsched.attention.batch import build_forward_batch
from ringsched.attention.paged import paged_attention
from ringsched.comm.messages import BatchPlan, PlanEntry
from ringsched.kv.cache import BlockTable


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
    from ringsched.attention.batch import CPU_GROUP_ROWS

    blocks = BlockTable(256, 4)
    n = CPU_GROUP_ROWS + 8
    for i in range(n):
        blocks.ensure(f"r{i}", 10)
    entries = [PlanEntry(f"r{i}", 9, [1], samples=True) for i in range(n)]
    batch, _ = build_forward_batch(BatchPlan(slot=0, seq=0, entries=entries), blocks, torch.device("cpu"))
    assert [len(g.rows) for g in batch.decodes] == [CPU_GROUP_ROWS, 8]
    assert sorted(torch.cat([g.rows for g in batch.decodes]).tolist()) == list(range(n))


def test_prefill_attention_does_not_materialise_the_scores():
    # A prefill chunk's attention must take torch's fused (flash) CPU kernel, not the math path that builds the
    # [heads, n, kv_len] score matrix (its softmax is the marker): the chunk and the continuation cases.
    from torch.profiler import ProfilerActivity, profile

    from ringsched.attention.paged import _sdpa

    torch.manual_seed(0)
    for n, kv_len in [(64, 64), (16, 80)]:
        q, k, v = torch.randn(n, 6, 8), torch.randn(kv_len, 2, 8), torch.randn(kv_len, 2, 8)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            out = _sdpa(q, k, v, 8**-0.5, causal=True)
        ops = {e.key for e in prof.key_averages()}
        assert "aten::_softmax" not in ops and "aten::bmm" not in ops, sorted(ops)
        # Same numbers as the reference: query i at position kv_len - n + i sees keys 0..kv_len - n + i.
        ke, ve = k.repeat_interleave(3, 1), v.repeat_interleave(3, 1)
        for i in (0, n - 1):
            seen = kv_len - n + i + 1
            ref = F.scaled_dot_product_attention(
                q[i].unsqueeze(1), ke[:seen].transpose(0, 1), ve[:seen].transpose(0, 1), scale=8**-0.5
            )
            torch.testing.assert_close(out[i], ref.squeeze(1), rtol=1e-5, atol=1e-5)


def test_one_rotary_table_per_stage():
    from ringsched.layout.rank import StageInfo
    from ringsched.models.llama import StageModel
    from ringsched.weights.model_config import ModelConfig

    cfg = ModelConfig.from_dict({
        "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 3, "hidden_size": 16, "intermediate_size": 32,
        "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 10,
    })  # fmt: skip
    model = StageModel(cfg, StageInfo(0, 1, 0, 3))
    rotaries = {id(layer.self_attn.rotary) for layer in model.model.layers}
    assert len(rotaries) == 1
