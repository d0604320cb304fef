"""The sliding layers' rings (`kv/ring.py`): the addressing keeps every position a step reads, the block table takes,
follows and frees rings with the main blocks, the pool sizes sliding layers' tensors by the ring, and a sliding
layer's attention over its ring equals the same attention over a whole-context pool."""

from __future__ import annotations

import random

import pytest
import torch

from ringsched.attention.batch import build_forward_batch
from ringsched.attention.paged import paged_attention
from ringsched.attention.window import WindowedAttention
from ringsched.comm.messages import BatchPlan, PlanEntry
from ringsched.config import EngineConfig
from ringsched.kernels import native
from ringsched.kv.cache import BlockTable, KVPool
from ringsched.kv.ring import RingTable, SlidingBlockTable, ring_size, split_budget
from ringsched.stage.kv_setup import ring_of
from ringsched.weights.model_config import ModelConfig

CFG = ModelConfig("MistralForCausalLM", 4, 32, 64, 4, 2, 8, 100, 1e-6, 1e4, 512, False,
                  layer_types=("sliding", "full", "sliding", "sliding"), sliding_window=8)  # fmt: skip


def test_ring_size_covers_the_window_and_a_chunk():
    assert ring_size(8, 8, 16) == 2 and ring_size(4096, 512, 16) == 289 and ring_size(16, 1, 16) == 2


@pytest.mark.parametrize(("window", "chunk", "bs"), [(8, 8, 4), (8, 3, 16), (5, 7, 2), (16, 1, 4)])
def test_a_ring_keeps_every_position_a_step_reads(window, chunk, bs):
    """Positions written through the ring in random chunks of up to `chunk`: each chunk's queries find their whole
    window (the positions [q - window + 1, q]) in the slots `window_slots` names, after the chunk's own writes."""
    ring = RingTable(ring_size(window, chunk, bs), bs, ring_size(window, chunk, bs), window)
    held: dict[int, int] = {}  # slot -> the position whose KV it holds
    rng, pos = random.Random(0), 0
    while pos < 20 * ring.ring * bs:
        n = rng.randint(1, chunk)
        ring.grow("r", -(-(pos + n) // bs))  # as the main table grows to hold the chunk
        for p, s in zip(range(pos, pos + n), ring.slots("r", pos, pos + n).tolist(), strict=True):
            held[s] = p
        ctx = pos + n
        slots = ring.window_slots("r", ctx, n).tolist()
        first = max(0, ctx - n - window + 1)
        assert [held[s] for s in slots] == list(range(first, ctx))
        pos = ctx


def test_block_tables_repeat_the_ring_per_absolute_block():
    ring = RingTable(6, 4, 3, 8)
    assert len(ring.grow("a", 2)) == 2 and ring.block_tables(["a"], [7]).tolist() == [ring.table.tables["a"]]
    blocks = ring.table.tables["a"] + ring.grow("a", 8)
    tables = ring.block_tables(["a"], [30])
    assert tables.tolist() == [[blocks[j % 3] for j in range(8)]]
    short = ring.grow("b", 1)  # a request shorter than the longest: its row is padded past its own blocks
    assert ring.block_tables(["a", "b"], [30, 3])[1, :1].tolist() == short


def test_the_block_table_grows_a_ring_with_the_main_blocks_up_to_its_size_and_frees_it_with_them():
    lead = SlidingBlockTable(16, 4, RingTable(5, 4, 3, 8))
    follow = SlidingBlockTable(16, 4, RingTable(5, 4, 3, 8, follower=True), follower=True)
    for tokens, new_ring in ((5, 2), (9, 1), (30, 0)):  # 2, 3, then 8 main blocks: the ring stops at 3
        grown = lead.grow("a", tokens)
        assert len(grown.get("ring_blocks", [])) == new_ring
        follow.follow(PlanEntry("a", 0, [], False, new_blocks=grown["new_blocks"],
                                ring_blocks=grown.get("ring_blocks", [])))  # as a plan carries them
    assert follow.ring.table.tables == lead.ring.table.tables and len(lead.ring.table.tables["a"]) == 3
    lead.grow("b", 3)  # a short request holds one ring block
    assert lead.can_hold("c", 4) and not lead.can_hold("c", 5)  # main blocks are free, the sliding pool has 1
    for t in (lead, follow):
        t.free("a")
    assert lead.can_hold("c", 40) and follow.ring.table.used_blocks == 0 and lead.ring.table.used_blocks == 1


def test_a_sliding_pool_smaller_than_a_ring_bounds_the_longest_request():
    assert SlidingBlockTable(16, 4, RingTable(2, 4, 3, 8)).capacity_tokens == 8
    assert SlidingBlockTable(16, 4, RingTable(3, 4, 3, 8)).capacity_tokens == 64


def test_sliding_layers_tensors_are_sized_by_the_rings():
    pool = KVPool(CFG, 4, 50, 16, torch.float32, "cpu", sliding=[True, False, True, True], ring_blocks=6)
    assert [k.shape[0] for k, _ in pool.caches] == [96, 800, 96, 96]
    assert pool.caches[0][1].shape == (96, 2, 8)
    assert pool.nbytes == (3 * 96 + 800) * 2 * 2 * 8 * 4


def test_the_budget_is_split_by_what_a_whole_context_request_holds_in_each_pool():
    assert ring_of(EngineConfig(model="m", chunked_prefill_size=8), CFG) == 2
    block = 16 * 2 * 2 * 8 * 4  # K and V of 16 tokens in one layer: 2 KV heads x 8, float32
    # 1 full + 3 sliding layers, contexts of 10 blocks, rings of 2: a request holds 10 + 3 x 2 blocks of layers
    assert split_budget(16 * block * 7, block, 1, 3, 2, 10) == (70, 14)
    # a context no longer than a ring: both pools alike (what a request holds in one it holds in the other)
    assert split_budget(40 * block, block, 1, 3, 12, 10) == (10, 10)
    assert split_budget(40 * block, block, 0, 4, 2, 10) == (-1, 10)  # sliding layers only: no main bound
    assert split_budget(40 * block, block, 4, 0, 2, 10) == (10, -1)
    # a budget short of one whole-context request: split as the longest request it holds (7 blocks: 7 + 3 x 2)
    assert split_budget(13 * block, block, 1, 3, 2, 100) == (7, 2)
    assert split_budget(8 * block, block, 1, 3, 12, 100) == (2, 2)  # that request shorter than a ring


@pytest.mark.parametrize("use_native", [False, True], ids=["torch", "native"])
def test_a_sliding_layer_reads_the_same_from_its_ring_as_from_the_whole_pool(use_native):
    """Two requests through a prefill in chunks and decodes: WindowedAttention over the rings equals it over a
    whole-context pool, every step (the rings wrap several times)."""
    if use_native and not native.usable_for(torch.float32, "cpu"):
        pytest.skip("no native decode kernel here")
    window, chunk, bs, kvh, heads, d = 8, 5, 4, 2, 4, 8
    ring = ring_size(window, chunk, bs)
    whole, ringed = BlockTable(64, bs), SlidingBlockTable(64, bs, RingTable(2 * ring, bs, ring, window))
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
                ringed.grow(rid, done[rid] + n)  # the ring grows with the main blocks, lazily
                done[rid] += n
        plan = BatchPlan(0, 0, entries)
        t = plan.num_tokens
        q, k, v = (torch.randn(t, h, d, generator=torch_rng) for h in (heads, kvh, kvh))
        full_batch, _ = build_forward_batch(plan, whole, "cpu", native=use_native)
        ring_batch, _ = build_forward_batch(plan, ringed, "cpu", native=use_native)
        want = paged_attention(q, k, v, full_batch, *caches["whole"], 0.3, attend)
        got = paged_attention(q, k, v, ring_batch.sliding, *caches["ring"], 0.3, attend)
        torch.testing.assert_close(got, want)
