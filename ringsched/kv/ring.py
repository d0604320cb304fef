"""The sliding layers' KV: a small pool of its own, each running request holding a ring of its blocks.

A sliding layer's query reads at most its last `window` positions, so a request needs only the positions a step can
read or write: a chunk of up to `max_chunk` new tokens and the `window - 1` before it, `window + max_chunk - 1`
positions, which touch at most `ring_size` blocks however they fall. Position `p` lives in block
`ring[(p // block_size) % len(ring)]`: older positions are overwritten, never read again.

Stage 0 takes a request's ring when it first grows the request's main table (`BlockTable.grow`: the plan entry's
`ring_blocks`); the other stages `assign` it from the plan; every rank frees it with the request's main blocks.
"""

from __future__ import annotations

import torch

from ringsched.kv.cache import BlockTable


def ring_size(window: int, max_chunk: int, block_size: int) -> int:
    """Blocks a request's ring needs: `window + max_chunk - 1` positions, one block more for their misalignment."""
    return -(-(window + max_chunk - 1) // block_size) + 1


class RingTable:
    """Which blocks of the sliding pool each request's ring holds (`ring` blocks each, taken at once)."""

    def __init__(self, num_blocks: int, block_size: int, ring: int, window: int, follower: bool = False) -> None:
        if num_blocks < ring:
            raise ValueError(f"the sliding pool holds {num_blocks} blocks, fewer than one ring of {ring}")
        self.table = BlockTable(num_blocks, block_size, follower=follower)
        self.block_size, self.ring, self.window = block_size, ring, window

    @property
    def num_blocks(self) -> int:
        return self.table.num_blocks

    def holds(self, rid: str) -> bool:
        return rid in self.table.tables

    def can_take(self, rid: str) -> bool:
        """Whether `rid` has its ring or one is free."""
        return self.holds(rid) or self.table.free_blocks >= self.ring

    def take(self, rid: str) -> list[int]:
        """`rid`'s ring, newly taken (stage 0; raises when the pool is short: check `can_take` first)."""
        if not self.table.ensure(rid, self.ring * self.block_size):
            raise RuntimeError(f"request {rid}: the sliding pool has no free ring (caller checks first)")
        return list(self.table.tables[rid])

    def assign(self, rid: str, blocks: list[int]) -> None:
        """Follow stage 0's ring for `rid` (the other stages)."""
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
            tables[i] = ring[torch.arange(nblk) % self.ring]
        return tables


def split_budget(budget: int, token_layer_bytes: int, full_layers: int, sliding_layers: int, sliding_blocks: int,
                 block_size: int) -> int:  # fmt: skip
    """Main-pool blocks `budget` bytes hold once the sliding layers have their `sliding_blocks` each (0 when those
    alone are over it); `token_layer_bytes`: K plus V of one token in one layer. -1 when the stage has no full
    layer and its rings fit: nothing bounds the main table by memory."""
    left = budget - sliding_layers * sliding_blocks * block_size * token_layer_bytes
    if left < 0:
        return 0
    return left // (full_layers * block_size * token_layer_bytes) if full_layers else -1
