"""The sliding layers' KV: a pool of its own, each running request holding a ring of its blocks.

A sliding layer's query reads at most its last `window` positions, so a request needs only the positions a step can
read or write: a chunk of up to `max_chunk` new tokens and the `window - 1` before it, `window + max_chunk - 1`
positions, which touch at most `ring_size` blocks however they fall. Position `p` lives in block
`ring[(p // block_size) % ring_size]`: older positions are overwritten, never read again.

A request's ring grows with its main table, to `min(main blocks, ring_size)` blocks: while it is shorter than a ring
its positions' blocks are its ring's in order, so a short request holds in the sliding pool what it holds in the main
one. Stage 0 takes the new ring blocks when it grows the request's main table (`BlockTable.grow`: the plan entry's
`ring_blocks`); the other stages `assign` them from the plan; every rank frees them with the request's main blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from ringsched.comm.messages import PlanEntry
from ringsched.kv.cache import BlockTable

T = TypeVar("T")


def ring_size(window: int, max_chunk: int, block_size: int) -> int:
    """Blocks a request's ring needs: `window + max_chunk - 1` positions, one block more for their misalignment."""
    return -(-(window + max_chunk - 1) // block_size) + 1


class RingTable:
    """Which blocks of the sliding pool each request's ring holds (up to `ring` each, grown with the main table)."""

    def __init__(self, num_blocks: int, block_size: int, ring: int, window: int, follower: bool = False) -> None:
        self.table = BlockTable(num_blocks, block_size, follower=follower)
        self.block_size, self.ring, self.window = block_size, ring, window

    @property
    def num_blocks(self) -> int:
        return self.table.num_blocks

    @property
    def longest_blocks(self) -> int | None:
        """Main blocks a request can reach before its ring would need more blocks than the pool has (None: any)."""
        return None if self.num_blocks >= self.ring else self.num_blocks

    def needed(self, rid: str, main_blocks: int) -> int:
        """Ring blocks `rid` still lacks once its main table holds `main_blocks`."""
        return max(min(main_blocks, self.ring) - len(self.table.tables.get(rid, ())), 0)

    def can_grow(self, rid: str, main_blocks: int) -> bool:
        return self.needed(rid, main_blocks) <= self.table.free_blocks

    def grow(self, rid: str, main_blocks: int) -> list[int]:
        """`rid`'s newly taken ring blocks for a main table of `main_blocks` (stage 0; check `can_grow` first)."""
        before = len(self.table.tables.get(rid, ()))
        if not self.table.ensure(rid, min(main_blocks, self.ring) * self.block_size):
            raise RuntimeError(f"request {rid}: the sliding pool cannot grow its ring (caller checks first)")
        return self.table.tables[rid][before:]

    def assign(self, rid: str, blocks: list[int]) -> None:
        """Follow stage 0's ring blocks for `rid` (the other stages)."""
        self.table.assign(rid, blocks)

    def free(self, rid: str) -> None:
        self.table.free(rid)

    def slots(self, rid: str, start: int, end: int) -> torch.Tensor:
        """Sliding-pool slot of each position in `[start, end)`."""
        ring = torch.tensor(self.table.tables[rid], dtype=torch.long)
        pos = torch.arange(start, end)
        return ring[(pos // self.block_size) % self.ring] * self.block_size + pos % self.block_size

    def window_slots(self, rid: str, ctx: int, n: int) -> torch.Tensor:
        """The slots a chunk of `n` new tokens ending at `ctx` reads: of positions `[ctx - n - window + 1, ctx)`
        (from 0 when shorter). `WindowedAttention` takes the last slots it needs."""
        return self.slots(rid, max(0, ctx - n - self.window + 1), ctx)

    def block_tables(self, rids: list[str], lengths: list[int]) -> torch.Tensor:
        """`[B, nblk]` a block for every absolute block of positions `0..len-1` (the ring repeated), so a kernel
        that reads block `t // block_size` of a table reads position `t`'s ring block; blocks older than the
        window are stale, and never read by a kernel given the window."""
        nblk = -(-max(lengths) // self.block_size)
        tables = torch.zeros(len(rids), nblk, dtype=torch.long)
        for i, rid in enumerate(rids):
            ring = torch.tensor(self.table.tables[rid], dtype=torch.long)
            tables[i] = ring[(torch.arange(nblk) % self.ring).clamp(max=len(ring) - 1)]  # past its length: padding
        return tables


class SlidingBlockTable(BlockTable):
    """The KV blocks of a stage with sliding layers: the main table, and the rings of the sliding pool taken, followed
    and freed with it (the plan entry's `ring_blocks` beside its `new_blocks`)."""

    def __init__(self, num_blocks: int, block_size: int, ring: RingTable, follower: bool = False) -> None:
        # No prefix caching: a cached prefix would have no KV in the sliding layers' rings.
        super().__init__(num_blocks, block_size, follower=follower)
        self.ring = ring

    @property
    def capacity_tokens(self) -> int:
        """The most tokens one request can hold (a sliding pool smaller than a ring bounds it too)."""
        return min(self.num_blocks, self.ring.longest_blocks or self.num_blocks) * self.block_size

    def can_hold(self, rid: str, num_tokens: int, shared: Sequence[int] = ()) -> bool:
        have = len(self.tables.get(rid, ())) + len(shared)
        need = max(-(-num_tokens // self.block_size) - have, 0)
        return super().can_hold(rid, num_tokens, shared) and self.ring.can_grow(rid, have + need)

    def grow(self, rid: str, num_tokens: int) -> dict:
        out = super().grow(rid, num_tokens)
        if ring := self.ring.grow(rid, len(self.tables[rid])):
            out["ring_blocks"] = ring
        return out

    def follow(self, e: PlanEntry, cp_rank: int = 0) -> None:
        super().follow(e, cp_rank)
        if e.ring_blocks:  # its ring grows with its main blocks
            self.ring.assign(e.rid, e.ring_blocks)

    def free(self, rid: str) -> None:
        self.ring.free(rid)
        super().free(rid)

    def sliding_view(self, make: Callable[..., T]) -> T:
        return make(self.ring)


def split_budget(
    budget: int, block_bytes: int, full_layers: int, sliding_layers: int, ring: int, context_blocks: int
) -> tuple[int, int]:
    """(main blocks, sliding blocks) that `budget` bytes hold, split in proportion to what a request of the longest
    length holds in each: `n` blocks in every full layer, `min(n, ring)` in every sliding layer, where `n` is the
    whole context's blocks or, if the budget cannot hold one such request, the blocks of the longest it can
    (`block_bytes`: K plus V of one block in one layer). -1 for a kind of layer the stage lacks: nothing there
    bounds that table by memory."""
    have = budget // block_bytes  # blocks of one layer
    n = context_blocks
    if full_layers and full_layers * n + sliding_layers * min(n, ring) > have:  # one request fills the budget
        whole = have // (full_layers + sliding_layers)  # as long as it is no longer than a ring
        n = max(whole if whole <= ring else (have - sliding_layers * ring) // full_layers, 1)
    held = min(n, ring)
    per_request = (full_layers * n + sliding_layers * held) * block_bytes
    main = budget * n // per_request if full_layers else -1
    return main, (budget * held // per_request if sliding_layers else -1)
