"""The sliding layers' rings (`kv/ring.py`): the addressing keeps every position a step reads, the block table takes,
follows and frees rings with the main blocks, the pool sizes sliding layers' tensors by the ring, and a sliding
layer's attention over its ring equals the same attention over a whole-context pool."""

from __future__ import annotations

import random

import pytest
import torch

from ringsched.comm.messages import BatchPlan, PlanEntry
from ringsched.config import EngineConfig
from ringsched.kv.cache import BlockTable, KVPool
from ringsched.kv.ring import RingTable, ring_size, split_budget
from ringsched.models import native
from ringsched.models.attention import paged_attention
from ringsched.models.batch import build_forward_batch
from ringsched.models.config import ModelConfig
from ringsched.models.window_attention import WindowedAttention
from ringsched.stage.setup import sliding_pool

CFG = ModelConfig("MistralForCausalLM", 4, 32, 64, 4, 2, 8, 100, 1e-6, 1e4, 512, False,
                  layer_types=("sliding", "full", "sliding", "sliding"), sliding_window=8)  # fmt: skip


def test_ring_size_covers_the_window_and_a_chunk():
    assert ring_size(8, 8, 16) == 2 and ring_size(4096, 512, 16) == 289 and ring_size(16, 1, 16) == 2


@pytest.mark.parametrize(("window", "chunk", "bs"), [(8, 8, 4), (8, 3, 16), (5, 7, 2), (16, 1, 4)])
def test_a_ring_keeps_every_position_a_step_reads(window, chunk, bs):
    """Positions written through the ring in random chunks of up to `chunk`: each chunk's queries find their whole
    window (the positions [q - window + 1, q]) in the slots `window_slots` names, after the chunk's own writes."""
    ring = RingTable(ring_size(window, chunk, bs), bs, ring_size(window, chunk, bs), window)
    ring.take("r")
    held: dict[int, int] = {}  # slot -> the position whose KV it holds
    rng, pos = random.Random(0), 0
    while pos < 20 * ring.ring * bs:
        n = rng.randint(1, chunk)
        for p, s in zip(range(pos, pos + n), ring.slots("r", pos, pos + n).tolist(), strict=True):
            held[s] = p
        ctx = pos + n
        slots = ring.window_slots("r", ctx, n).tolist()
        first = max(0, ctx - n - window + 1)
        assert [held[s] for s in slots] == list(range(first, ctx))
        pos = ctx


def test_block_tables_repeat_the_ring_per_absolute_block():
    ring = RingTable(6, 4, 3, 8)
    blocks = ring.take("a")
    tables = ring.block_tables(["a"], [30])
    assert tables.tolist() == [[blocks[j % 3] for j in range(8)]]


def test_the_block_table_takes_a_ring_with_the_first_blocks_and_frees_it_with_them():
    lead = BlockTable(16, 4, ring=RingTable(6, 4, 3, 8))
    follow = BlockTable(16, 4, follower=True, ring=RingTable(6, 4, 3, 8, follower=True))
    first = lead.grow("a", 5)
    assert len(first["ring_blocks"]) == 3 and "ring_blocks" not in lead.grow("a", 9)
    follow.assign("a", first["new_blocks"])
    follow.ring.assign("a", first["ring_blocks"])
    assert follow.ring.table.tables == lead.ring.table.tables
    lead.grow("b", 3)
    assert not lead.can_hold("c", 1)  # main blocks are free, but no third ring
    for t in (lead, follow):
        t.free("a")
    assert lead.can_hold("c", 1) and follow.ring.table.used_blocks == 0 and lead.ring.table.used_blocks == 3


def test_sliding_layers_tensors_are_sized_by_the_rings():
    pool = KVPool(CFG, 4, 50, 16, torch.float32, "cpu", sliding=[True, False, True, True], ring_blocks=6)
    assert [k.shape[0] for k, _ in pool.caches] == [96, 800, 96, 96]
    assert pool.caches[0][1].shape == (96, 2, 8)
    assert pool.nbytes == (3 * 96 + 800) * 2 * 2 * 8 * 4


def test_the_budget_goes_to_the_rings_first_then_to_the_full_layers():
    ring, blocks = sliding_pool(EngineConfig(model="m", chunked_prefill_size=8, max_running_requests=4), CFG)
    assert (ring, blocks) == (2, 8)
    per = 2 * 2 * 8 * 4  # K and V of one token in one layer: 2 KV heads x 8, float32
    budget = 3 * blocks * 16 * per + 100 * 16 * per
    assert split_budget(budget, per, 1, 3, blocks, 16) == 100
    assert split_budget(budget, per, 0, 3, blocks, 16) == -1  # sliding layers only: memory bounds no main table
    assert split_budget(100, per, 1, 3, blocks, 16) == 0


@pytest.mark.parametrize("use_native", [False, True], ids=["torch", "native"])
def test_a_sliding_layer_reads_the_same_from_its_ring_as_from_the_whole_pool(use_native):
    """Two requests through a prefill in chunks and decodes: WindowedAttention over the rings equals it over a
    whole-context pool, every step (the rings wrap several times)."""
    if use_native and not native.usable_for(torch.float32, "cpu"):
        pytest.skip("no native decode kernel here")
    window, chunk, bs, kvh, heads, d = 8, 5, 4, 2, 4, 8
    ring = ring_size(window, chunk, bs)
    whole, ringed = BlockTable(64, bs), BlockTable(64, bs, ring=RingTable(2 * ring, bs, ring, window))
    caches = {"whole": [torch.zeros(64 * bs, kvh, d) for _ in range(2)],
              "ring": [torch.zeros(2 * ring * bs, kvh, d) for _ in range(2)]}  # fmt: skip
    attend, torch_rng = WindowedAttention(window, 0.0), torch.Generator().manual_seed(0)
    lengths, done = {"a": 23, "b": 40}, {"a": 0, "b": 0}
    while any(done[r] < lengths[r] for r in done):
        entries = []
        for rid in done:
            n = min(chunk, lengths[rid] - done[rid]) if done[rid] < 20 else min(1, lengths[rid] - done[rid])
            if n:
                entries.append(PlanEntry(rid, done[rid], [1] * n, True))
                whole.grow(rid, done[rid] + n)
                ringed.grow(rid, done[rid] + n)
                done[rid] += n
        plan = BatchPlan(0, 0, entries)
        t = plan.num_tokens
        q, k, v = (torch.randn(t, h, d, generator=torch_rng) for h in (heads, kvh, kvh))
        full_batch, _ = build_forward_batch(plan, whole, "cpu", native=use_native)
        ring_batch, _ = build_forward_batch(plan, ringed, "cpu", native=use_native)
        want = paged_attention(q, k, v, full_batch, *caches["whole"], 0.3, attend)
        got = paged_attention(q, k, v, ring_batch.sliding, *caches["ring"], 0.3, attend)
        torch.testing.assert_close(got, want)
