"""Prefix caching in stage 0's block table, as plain data: hashing, lookup, sharing, eviction, the planner's
use of it, and a follower stage that applies the same plans holding the same tables."""

import random

from ringsched.comm.messages import NewRequest
from ringsched.kv.cache import BlockTable, block_hashes
from ringsched.layout.rank import Layout, rank_infos
from ringsched.sampling.params import SamplingParams
from ringsched.scheduler.planner import Planner
from ringsched.stage.plans import FollowPlans
from ringsched.stage.sampler_state import SamplerState

BS = 16


def planner(blocks=64, mbs=4, running=8, budget=512, flexible_cut=False):
    table = BlockTable(blocks, BS, prefix_caching=True)
    return Planner(table, mbs, running, budget, eos_ids=(2,), max_len=4096, flexible_cut=flexible_cut)


def req(rid, ids, max_tokens=4, **kw):
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **kw)
    return NewRequest(rid, list(ids), params.to_dict())


def prefix(n, start=100):
    return list(range(start, start + n))


def run_to_end(p, seq, slot=0):
    """Plan and answer micro-batches (token 7 for every sample) until nothing is left; the next seq."""
    while p.has_work:
        plan = p.plan(slot, seq)
        p.on_output(seq, [7] * plan.num_samples)
        seq += 1
    return seq


def test_chained_hashes_cover_the_whole_prefix():
    a = block_hashes(prefix(40), BS, [])
    assert len(a) == 2  # full blocks only
    b = block_hashes(prefix(40)[:16] + [1] + prefix(40)[17:], BS, [])
    assert a[0] == b[0] and a[1] != b[1]
    c = block_hashes([5] + prefix(40)[1:], BS, [])  # a different first block changes every later hash
    assert c[0] != a[0] and c[1] != a[1]
    assert block_hashes(prefix(40), BS, a[:1]) == a  # extended from what it had


def test_a_second_request_computes_only_past_the_cached_blocks():
    p = planner()
    p.add(req("a", prefix(40)))
    seq = run_to_end(p, 0)
    assert p.blocks.used_blocks == 0 and p.blocks.cached_idle_blocks == 2  # a's two full prompt blocks
    p.add(req("b", prefix(32) + [9, 9, 9, 9, 9]))
    plan = p.plan(0, seq)
    (e,) = plan.entries
    assert e.start == 32 and e.token_ids == [9] * 5
    assert e.cached_ids == prefix(32) and len(e.cached_blocks) == 2 and e.new_blocks == [e.cached_blocks[-1] + 1]
    assert p.blocks.tables["b"] == e.cached_blocks + e.new_blocks
    assert p.stats()["prefix_cache_hits"] == 32 and p.stats()["prefix_cache_queries"] == 40 + 37
    out = p.on_output(seq, [7])
    assert out[0].cached_tokens == 32
    assert p.prefill_tokens == 40 + 5  # planned computation: a whole, b's tail


def test_the_last_token_of_a_fully_cached_prompt_is_computed():
    p = planner()
    p.add(req("a", prefix(32)))
    seq = run_to_end(p, 0)
    p.add(req("b", prefix(32)))
    (e,) = p.plan(0, seq).entries
    assert (e.start, e.token_ids, e.samples) == (16, prefix(32)[16:], True)  # one block short: 31 is computed
    p.on_output(seq, [7])
    p.add(req("c", prefix(33)))
    (e,) = [e for e in p.plan(1, seq + 1).entries if e.rid == "c"]
    assert (e.start, e.token_ids) == (32, [132])


def test_a_request_waits_a_micro_batch_for_blocks_computed_beside_it():
    p = planner(budget=64)
    p.add(req("a", prefix(100)))
    p.add(req("b", prefix(100)))
    first = p.plan(0, 0)  # a's first 64 tokens; b's would be the same blocks: it waits
    assert [(e.rid, e.start) for e in first.entries] == [("a", 0)]
    second = p.plan(1, 1)  # a's rest: b's next block is among them, so it waits again
    assert [(e.rid, e.start) for e in second.entries] == [("a", 64)]
    third = p.plan(2, 2)  # everything but a's partial last block is cached (a is still in flight)
    assert [(e.rid, e.start) for e in third.entries] == [("b", 96)]
    assert third.entries[0].cached_blocks == p.blocks.tables["a"][:6]


def test_siblings_compute_a_shared_prompt_once():
    p = planner()
    for i in range(3):  # n = 3: the same prompt, arriving together
        p.add(req(f"s{i}", prefix(40)))
    assert [(e.rid, e.start) for e in p.plan(0, 0).entries] == [("s0", 0)]
    assert [(e.rid, e.start, len(e.token_ids)) for e in p.plan(1, 1).entries] == [("s1", 32, 8), ("s2", 32, 8)]
    assert p.prefill_tokens == 40 + 2 * 8


def test_a_flexible_cut_indexes_blocks_when_their_micro_batch_is_back():
    p = planner(budget=64, flexible_cut=True)
    p.add(req("a", prefix(100)))
    p.plan(0, 0)
    p.add(req("b", prefix(100)))
    # a's second chunk goes around behind its first; b starts from 0: a's blocks are not back yet
    assert [(e.rid, e.start) for e in p.plan(1, 1).entries] == [("a", 64), ("b", 0)]
    hashes = block_hashes(prefix(64), BS, [])
    assert p.blocks.cache.lookup(hashes) == []
    p.on_output(0, [])
    assert p.blocks.cache.lookup(hashes) == p.blocks.tables["a"][:4]


def test_idle_cached_blocks_are_free_capacity_evicted_least_recently_used():
    p = planner(blocks=8, mbs=1, running=1)  # 128 tokens
    p.add(req("a", prefix(48, 100), max_tokens=1))
    seq = run_to_end(p, 0)
    p.add(req("b", prefix(48, 500), max_tokens=1))
    seq = run_to_end(p, seq)
    a_blocks = p.blocks.cache.lookup(block_hashes(prefix(48, 100), BS, []))
    assert len(a_blocks) == 3 and p.blocks.used_blocks == 0 and p.blocks.free_blocks == 8
    assert p.blocks.cached_idle_blocks == 6
    # c needs 5 blocks: the 2 never used, then 3 evicted, a's (the least recently used) first, tail first.
    p.add(req("c", prefix(65, 900), max_tokens=1))
    (e,) = p.plan(0, seq).entries
    assert set(a_blocks) <= set(e.new_blocks)
    assert p.blocks.cache.lookup(block_hashes(prefix(48, 100), BS, [])) == []
    assert len(p.blocks.cache.lookup(block_hashes(prefix(48, 500), BS, []))) == 3  # b's stay


def test_an_idle_cached_block_taken_back_counts_against_the_pool():
    table = BlockTable(4, BS, prefix_caching=True)
    table.ensure("a", 64)
    table.index("a", block_hashes(prefix(64), BS, []))
    table.free("a")
    assert table.free_blocks == 4 and table.cached_idle_blocks == 4
    shared = table.cache.lookup(block_hashes(prefix(64), BS, []))[:3]
    assert table.can_hold("b", 64, shared) and not table.can_hold("b", 65, shared)
    table.share("b", shared)
    assert table.used_blocks == 3 and table.cached_idle_blocks == 1
    assert table.ensure("b", 64) and table.cached_idle_blocks == 0  # the last one was evicted for b's tail
    table.free("b")
    assert table.used_blocks == 0 and table.free_blocks == 4


def test_preemption_keeps_what_is_cached():
    p = planner(blocks=10, mbs=2, running=2, budget=512)  # 160 tokens
    p.add(req("old", prefix(40, 100), max_tokens=60))
    p.add(req("new", prefix(40, 300), max_tokens=60))
    seq, slot = 0, 0
    while p.num_preemptions == 0:
        plan = p.plan(slot, seq)
        p.on_output(seq, [7] * plan.num_samples)
        seq, slot = seq + 1, 1 - slot
    hits = p.stats()["prefix_cache_hits"]
    run_to_end(p, seq)
    assert p.stats()["prefix_cache_hits"] > hits  # the preempted request came back to its own cached blocks
    assert p.blocks.used_blocks == 0


def follow(blocks):
    return FollowPlans(rank_infos(Layout(2), [1, 1])[1], None, blocks, None, None, None, None)


def test_a_follower_given_the_same_plans_holds_identical_tables_through_aborts_and_preemption():
    rng = random.Random(3)
    p = planner(blocks=24, mbs=3, running=6, budget=48)
    follower = BlockTable(24, BS, follower=True)
    apply = follow(follower).apply
    sampler = SamplerState("cpu")
    heads = [prefix(40, 100), prefix(24, 300), prefix(70, 600)]
    in_flight, seq, n = {}, 0, 0
    for step in range(400):
        if step < 300 and rng.random() < 0.5:
            tail = [rng.randrange(1000, 2000) for _ in range(rng.randrange(3))]
            ids = rng.choice(heads)[: rng.randrange(1, 70)] + tail
            p.add(req(f"r{n}", ids, max_tokens=rng.randrange(1, 80)))
            n += 1
        if rng.random() < 0.04 and p.requests:
            p.abort(rng.choice(sorted(p.requests)))
        plan = p.plan(seq % 3, seq)
        apply(plan)
        sampler.apply(plan)
        for e in plan.entries:  # the sampling history: every token up to the entry's end, the cached ones too
            assert sampler.history[e.rid][e.start :] == e.token_ids and len(sampler.history[e.rid]) == e.start + len(
                e.token_ids
            )
        assert follower.tables == p.blocks.tables and follower.used_blocks == p.blocks.used_blocks
        in_flight[seq] = plan.num_samples
        seq += 1
        if len(in_flight) == 3 or rng.random() < 0.3:  # the oldest micro-batch comes back
            old = min(in_flight)
            p.on_output(old, [7] * in_flight.pop(old))
    for old in sorted(in_flight):
        p.on_output(old, [7] * in_flight[old])
    while p.has_work:
        for rid in list(p.requests):
            p.abort(rid)
        plan = p.plan(seq % 3, seq)
        apply(plan)
        p.on_output(seq, [7] * plan.num_samples)
        seq += 1
    assert p.stats()["prefix_cache_hits"] > 0 and p.num_preemptions > 0
    # No reference left anywhere: nothing in use, every block free or idle with its prefix.
    assert p.blocks.used_blocks == 0 and follower.used_blocks == 0 and follower.tables == {} == p.blocks.tables
    assert p.blocks.free_blocks == 24 and all(c == 0 for c in p.blocks._refs) and all(c == 0 for c in follower._refs)
    assert set(p.blocks.cache.idle) == set(p.blocks.cache.hash_of)
