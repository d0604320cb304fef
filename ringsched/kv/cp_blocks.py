"""Where a request's tokens live in a stage's context-parallel group: stage 0's allocator over every CP rank's
KV pool (`CPBlocks`), and the positions each rank stores, which every rank rebuilds from the plans
(`CPPlacement`). Plain data: no processes, no model.

The placement rule (stage 0 decides it; the plan entry carries its outcome as `cp_counts`, the tokens each CP
rank computes and stores, and `cp_blocks`, each rank's new KV blocks):

- a chunk of `n >= 2 x cp_size` tokens is split zigzag over every rank (`cp_split.zigzag_pieces`): each rank takes
  `n // cp_size` tokens, and the `n % cp_size` left over go to the ranks holding the fewest of the request's
  tokens (ties: the lower rank);
- a shorter chunk, and every decode token, goes whole to the rank holding the fewest (ties: the lower rank).

So a request's ranks never hold more than `2 x cp_size - 1` tokens apart, and a request of `T` tokens needs
at most `ceil(T / cp_size) + 2 x cp_size - 1` tokens of any one rank's pool (`request_capacity`).

An entry replaces whatever its request held from the entry's start on: a speculative entry's rejected drafts
(`--speculative-config`) are the tail of its ranks' storage, dropped when the request's next entry starts before
them (`CPPlacement.apply` on every rank; `CPBlocks.rewind` on stage 0 when the kept tokens come back).
"""

from __future__ import annotations

import torch

from ringsched.comm.messages import BatchPlan, PlanEntry
from ringsched.kv.cache import BlockTable
from ringsched.layout.cp_split import zigzag_pieces


def shares_for(have: list[int], n: int) -> list[int]:
    """How many of `n` new tokens each CP rank takes, given the request's tokens `have` on each (the rule above)."""
    size = len(have)
    order = sorted(range(size), key=lambda r: (have[r], r))  # the least loaded first
    shares = [0] * size
    if size > 1 and n >= 2 * size:
        base, extra = divmod(n, size)
        shares = [base + (r in order[:extra]) for r in range(size)]
    else:
        shares[order[0]] = n
    return shares


def is_split(counts: list[int]) -> bool:
    """An entry computed by more than one CP rank (ring attention), rather than by one (its queries travel)."""
    return sum(1 for c in counts if c) > 1


def request_capacity(rank_tokens: int, size: int) -> int:
    """The longest request (prompt plus output tokens) a CP group of `size` ranks, each with a pool of
    `rank_tokens`, can always hold: the most-loaded rank holds at most `ceil(T / size) + 2 x size - 1`."""
    if size == 1:
        return rank_tokens
    return max(size * (rank_tokens - 2 * size + 1), 0)


class CPBlocks:
    """Stage 0's allocator for a CP group: one `BlockTable` per CP rank (the rank's pool; index 0 is stage 0's own),
    and each request's token count per rank. It has the `BlockTable` methods the planner calls (`can_hold`,
    `grow`, `free`, `capacity_tokens`, `usage`), with `grow` returning the plan entry's `cp_counts` and
    `cp_blocks`. No prefix cache: a cached prefix would have to sit where the placement rule puts its tokens."""

    cache = None
    scores_prompts = False  # a chunk's positions are split over the ranks: no rank has every row to score

    def __init__(self, tables: list[BlockTable]) -> None:
        self.tables, self.size = tables, len(tables)
        self.block_size = tables[0].block_size
        self.counts: dict[str, list[int]] = {}
        self._last: dict[str, tuple[int, list[int]]] = {}  # each request's last entry: its start and shares

    def _have(self, rid: str) -> list[int]:
        return self.counts.get(rid, [0] * self.size)

    def _fits(self, rid: str, have: list[int], shares: list[int]) -> bool:
        return all(t.can_hold(rid, have[r] + shares[r]) for r, t in enumerate(self.tables))

    def _kept(self, rid: str, length: int) -> list[int]:
        """`rid`'s tokens per rank once its positions from `length` on are dropped (they are its last entry's)."""
        have = self._have(rid)
        if sum(have) <= length:
            return have
        start, shares = self._last[rid]
        if length < start:
            raise RuntimeError(f"request {rid}: cannot drop positions from {length}, before its last entry ({start})")
        return [h - int((p >= length - start).sum()) for h, p in zip(have, zigzag_pieces(shares), strict=True)]

    def rewind(self, rid: str, length: int) -> None:
        """`rid` keeps its first `length` positions (a verified entry's rejected drafts go); the blocks stay its."""
        if rid in self.counts:
            self.counts[rid] = self._kept(rid, length)

    def can_extend(self, e: PlanEntry, end: int) -> bool:
        """Whether entry `e` (its request's last) can be placed again to end at position `end`."""
        have = self._kept(e.rid, e.start)
        return self._fits(e.rid, have, shares_for(have, end - e.start))

    def extend(self, e: PlanEntry, end: int) -> None:
        """Place entry `e` again, as one chunk ending at `end` (drafts after its token); its CP fields follow."""
        self.rewind(e.rid, e.start)
        grown = self.grow(e.rid, end)
        e.cp_counts = grown["cp_counts"]
        e.cp_blocks = [a + b for a, b in zip(e.cp_blocks, grown["cp_blocks"], strict=True)]

    def can_hold(self, rid: str, num_tokens: int, shared: tuple = ()) -> bool:
        """Whether `rid` can grow to `num_tokens` tokens, placed by the rule (`shared`: no cached prefix here)."""
        assert not shared, "CP stages run without a prefix cache"
        have = self._have(rid)
        return self._fits(rid, have, shares_for(have, num_tokens - sum(have)))

    def grow(self, rid: str, num_tokens: int) -> dict:
        """Place `rid`'s tokens up to `num_tokens` and allocate their blocks; the plan entry's CP fields."""
        have = self._have(rid)
        shares = shares_for(have, num_tokens - sum(have))
        if not self._fits(rid, have, shares):
            raise RuntimeError(f"request {rid}: the CP pools cannot hold {num_tokens} tokens (caller checks first)")
        new = []
        for r, t in enumerate(self.tables):
            before = len(t.tables.get(rid, ()))
            t.ensure(rid, have[r] + shares[r])
            new.append(t.tables[rid][before:])
        self.counts[rid] = [h + s for h, s in zip(have, shares, strict=True)]
        self._last[rid] = (sum(have), shares)
        return {"cp_counts": shares, "cp_blocks": new}

    def free(self, rid: str) -> None:
        for t in self.tables:
            t.free(rid)
        self.counts.pop(rid, None)
        self._last.pop(rid, None)

    @property
    def capacity_tokens(self) -> int:
        return request_capacity(self.tables[0].capacity_tokens, self.size)

    @property
    def usage(self) -> float:
        return max(t.usage for t in self.tables)

    @property
    def used_blocks(self) -> int:
        return sum(t.used_blocks for t in self.tables)


class CPPlacement:
    """The positions each CP rank stores for each request, in the order it stores them (its storage index `i`
    holds position `positions(rid, rank)[i]`, in slot `BlockTable.slots(rid, i, i + 1)` of that rank's table).
    Every rank of a CP group applies every plan, so all hold the same placement without asking each other."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._pieces: dict[str, list[list[torch.Tensor]]] = {}
        self._cat: dict[tuple[str, int], torch.Tensor] = {}

    def apply(self, plan: BatchPlan) -> None:
        """Frees first (as every stage applies them), then each entry's tokens appended to their ranks, after what
        its request held from the entry's start on is dropped."""
        for rid in plan.frees:
            self._pieces.pop(rid, None)
            for r in range(self.size):
                self._cat.pop((rid, r), None)
        for e in plan.entries:
            if e.rid in self._pieces:
                self._drop_from(e.rid, e.start)
            pieces = self._pieces.setdefault(e.rid, [[] for _ in range(self.size)])
            for r, offsets in enumerate(zigzag_pieces(e.cp_counts)):
                if offsets.numel():
                    pieces[r].append(offsets + e.start)
                    self._cat.pop((e.rid, r), None)

    def _drop_from(self, rid: str, start: int) -> None:
        for r in range(self.size):
            held = self.positions(rid, r)
            if held.numel() and int(held[-1]) >= start:  # stored in increasing order: the tail goes
                self._cat[(rid, r)] = kept = held[held < start]
                self._pieces[rid][r] = [kept]

    def positions(self, rid: str, rank: int) -> torch.Tensor:
        """`[count]` int64: the positions `rank` stores for `rid`, in storage order."""
        key = (rid, rank)
        if key not in self._cat:
            pieces = self._pieces.get(rid, [[]] * self.size)[rank]
            self._cat[key] = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.long)
            if len(pieces) > 1:  # one piece from now on: a long generation appends one token at a time
                pieces[:] = [self._cat[key]]
        return self._cat[key]

    def count(self, rid: str, rank: int) -> int:
        return int(self.positions(rid, rank).numel())

    def __contains__(self, rid: str) -> bool:
        return rid in self._pieces
