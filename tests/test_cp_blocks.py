"""Context parallelism's placement as plain data: the rule that splits a chunk or gives it to one rank, the balance
it keeps (and the request capacity that follows), stage 0's allocator over every CP rank's pool, the positions
every rank rebuilds from the plans, and the planner carrying it all in its plans (drafted entries too)."""

import random

import pytest

from ringsched.comm.messages import BatchPlan, NewRequest, PlanEntry, decode, encode
from ringsched.kv.cache import BlockTable
from ringsched.kv.cp_blocks import CPBlocks, CPPlacement, is_split, request_capacity, shares_for
from ringsched.layout.cp_split import zigzag_pieces, zigzag_split
from ringsched.layout.rank import Layout, rank_infos
from ringsched.scheduler.planner import Planner
from ringsched.scheduler.speculation import Speculator
from ringsched.speculative.config import SpeculativeConfig
from ringsched.speculative.verify import padded
from ringsched.stage.plans import FollowPlans


def test_zigzag_pieces_is_the_zigzag_split_for_equal_shares():
    for n, size in [(8, 2), (64, 4), (24, 3)]:
        got = [p.tolist() for p in zigzag_pieces([n // size] * size)]
        assert got == [p.tolist() for p in zigzag_split(n, size)]
    assert [p.tolist() for p in zigzag_pieces([3, 2])] == [[0, 3, 4], [1, 2]]  # fronts 1 and 1, backs 1 and 2
    assert [p.tolist() for p in zigzag_pieces([0, 5, 0])] == [[], [0, 1, 2, 3, 4], []]  # one owner: in order


@pytest.mark.parametrize("shares", [[5, 4], [7, 7, 6], [2, 2, 2, 3], [0, 3], [1, 0, 0]])
def test_zigzag_pieces_cover_the_chunk_once_each_rank_its_share(shares):
    pieces = zigzag_pieces(shares)
    assert sorted(int(x) for p in pieces for x in p) == list(range(sum(shares)))
    assert [p.numel() for p in pieces] == shares
    assert all(p.tolist() == sorted(p.tolist()) for p in pieces)


def test_the_placement_rule():
    assert shares_for([0, 0], 9) == [5, 4]  # split: the extra token to the least loaded, ties to the lower rank
    assert shares_for([5, 4], 9) == [4, 5]
    assert shares_for([0, 0], 3) == [3, 0]  # shorter than 2 x cp_size: one rank, the least loaded
    assert shares_for([3, 0], 1) == [0, 1]
    assert shares_for([4, 4, 3], 1) == [0, 0, 1]
    assert shares_for([0, 0, 0], 6) == [2, 2, 2]
    assert shares_for([7], 7) == [7]  # no CP
    assert is_split([4, 5]) and not is_split([0, 3]) and not is_split([1])


@pytest.mark.parametrize("size", [2, 3, 4])
def test_placement_keeps_ranks_within_the_bound_and_the_capacity_holds(size):
    """Chunks of any length and decodes: a request's ranks never differ by more than 2 x size - 1 tokens, so
    `request_capacity` tokens always fit in pools of `rank_tokens` each."""
    rng = random.Random(size)
    rank_tokens = 40 * 16
    for _ in range(200):
        have = [0] * size
        total = request_capacity(rank_tokens, size)
        while sum(have) < total:
            n = min(rng.choice([1, 1, 2, size, 2 * size - 1, 2 * size, 17, 100, 512]), total - sum(have))
            have = [h + s for h, s in zip(have, shares_for(have, n), strict=True)]
            assert max(have) - min(have) <= 2 * size - 1, have
        assert max(have) <= rank_tokens
    assert request_capacity(rank_tokens, 1) == rank_tokens


def _entry_plan(alloc: CPBlocks, seq: int, chunks: list[tuple[str, int, int]], frees=()) -> BatchPlan:
    plan = BatchPlan(slot=seq % 2, seq=seq, frees=list(frees))
    for rid in frees:
        alloc.free(rid)
    for rid, start, n in chunks:
        plan.entries.append(PlanEntry(rid, start, list(range(start, start + n)), True, **alloc.grow(rid, start + n)))
    return plan


def test_allocator_and_followers_agree_and_positions_cover_the_request():
    size = 2
    alloc = CPBlocks([BlockTable(32, 4) for _ in range(size)])
    plans = [
        _entry_plan(alloc, 0, [("a", 0, 21), ("b", 0, 3)]),
        _entry_plan(alloc, 1, [("a", 21, 10), ("b", 3, 1)]),
        _entry_plan(alloc, 2, [("a", 31, 1), ("b", 4, 1)]),
    ]
    assert plans[0].entries[0].cp_counts == [11, 10] and plans[0].entries[1].cp_counts == [3, 0]
    # Every rank of the group: its own table from the plans, and the same placement.
    followers = []
    for r in range(size):
        table = BlockTable(32, 4, follower=True)
        placement = CPPlacement(size)
        where = rank_infos(Layout(pp_size=1, cp_size=size), [30])[r]
        follow = FollowPlans(where, None, table, None, None, None, None)  # applying plans needs none of the IO
        for p in plans:
            p = decode(encode(p))  # as it travels
            follow.apply(p)
            placement.apply(p)
        assert table.tables == alloc.tables[r].tables
        followers.append(placement)
    for rid, total in (("a", 32), ("b", 5)):
        got = sorted(int(x) for r in range(size) for x in followers[0].positions(rid, r))
        assert got == list(range(total))
        assert [followers[0].count(rid, r) for r in range(size)] == alloc.counts[rid]
        for r in range(size):
            assert followers[1].positions(rid, r).tolist() == followers[0].positions(rid, r).tolist()
    placement = followers[0]
    placement.apply(_entry_plan(alloc, 3, [], frees=["a"]))
    assert "a" not in placement and "a" not in alloc.counts
    assert all("a" not in t.tables for t in alloc.tables)
    assert alloc.used_blocks == sum(len(t.tables["b"]) for t in alloc.tables)


def test_planner_places_tokens_and_refuses_what_no_rank_group_holds():
    size = 2
    alloc = CPBlocks([BlockTable(8, 16) for _ in range(size)])  # 128 tokens a rank
    p = Planner(alloc, micro_batch_size=4, max_running=8, token_budget=64, eos_ids=(), max_len=10_000)
    assert alloc.capacity_tokens == request_capacity(128, 2) == 250
    refused = p.add(NewRequest("big", list(range(1, 250)), {"max_tokens": 8}))
    assert refused is not None and "--cp-size" in refused.error and "--kv-cache-memory" in refused.error
    assert p.add(NewRequest("long", list(range(1, 200)), {"max_tokens": 40})) is None  # 239 > one rank's 128
    seq, done = 0, False
    while not done:
        plan = p.plan(seq % 2, seq)
        for e in plan.entries:
            assert sum(e.cp_counts) == len(e.token_ids) and len(e.cp_blocks) == size and not e.new_blocks
        outs = p.on_output(seq, [7] * plan.num_samples)
        done = any(o.finish_reason for o in outs)
        seq += 1
    counts = [len(t.tables.get("long", [])) for t in alloc.tables]
    assert p.plan(seq % 2, seq).frees == ["long"] and alloc.used_blocks == 0, counts


def test_drafted_entries_keep_the_allocator_and_the_placement_agreeing():
    """Speculative entries at CP=2: a drafted entry is placed as one chunk (split when long enough), its rejected
    drafts dropped on stage 0 when its tokens come back and on every rank when the next entry arrives; the
    placement then holds each position below the entry's end once, as many per rank as stage 0 counts."""
    size, rng = 2, random.Random(4)
    alloc = CPBlocks([BlockTable(32, 4) for _ in range(size)])
    spec = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 1})
    p = Planner(alloc, micro_batch_size=4, max_running=8, token_budget=64, eos_ids=(), max_len=10_000,
                speculator=Speculator(spec, alloc, 10_000))  # fmt: skip
    assert p.add(NewRequest("a", [1, 2, 3, 4] * 5, {"max_tokens": 40, "ignore_eos": True})) is None
    placement, drafted, seq, done = CPPlacement(size), [], 0, False
    while not done:
        plan = decode(encode(p.plan(seq % 2, seq)))
        placement.apply(plan)
        values = []
        for e in plan.entries:
            end = e.start + len(e.token_ids)
            assert sorted(int(x) for r in range(size) for x in placement.positions("a", r)) == list(range(end))
            assert [placement.count("a", r) for r in range(size)] == alloc.counts["a"]
            drafts = e.token_ids[len(e.token_ids) - e.drafts :]
            kept = drafts[: rng.randint(0, e.drafts)] + [rng.choice([1, 2, 3, 4])]
            values += padded(kept, 1 + e.drafts)
            drafted.append((e.drafts, len(kept), max(e.cp_counts) < len(e.token_ids)))
        done = any(o.finish_reason for o in p.on_output(seq, values))
        seq += 1
    assert any(d and k <= d for d, k, _ in drafted), "no draft was rejected"
    assert any(d and split for d, _, split in drafted), "no drafted entry was split over the ranks"
    p.plan(seq % 2, seq)
    assert alloc.used_blocks == 0
