"""Paged KV cache: a block allocator (plain data) and the per-layer cache tensors of one stage.

Every stage has a `BlockTable` of the same capacity (the minimum over stages). Only stage 0 allocates: the
block numbers it picks travel in each plan entry (`new_blocks`) and the other stages `assign` them, so block
numbers agree on every stage without a second allocator that could drift.
"""

from __future__ import annotations

import torch

from ringsched.models.config import ModelConfig


class BlockTable:
    """Which blocks each request holds. Deterministic: the same calls give the same blocks."""

    def __init__(self, num_blocks: int, block_size: int, follower: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError("the KV pool holds no block; raise --kv-cache-memory")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.follower = follower  # takes its block numbers from plans (`assign`), never allocates
        self._used = 0
        # Popped from the end: lowest block numbers first, and freed blocks are reused first.
        self._free = list(range(num_blocks - 1, -1, -1))
        self.tables: dict[str, list[int]] = {}

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def free_blocks(self) -> int:
        return self.num_blocks - self._used

    @property
    def used_blocks(self) -> int:
        return self._used

    @property
    def usage(self) -> float:
        return self.used_blocks / self.num_blocks

    def blocks_needed(self, rid: str, num_tokens: int) -> int:
        have = len(self.tables.get(rid, ()))
        return max(-(-num_tokens // self.block_size) - have, 0)

    def can_hold(self, rid: str, num_tokens: int) -> bool:
        return self.blocks_needed(rid, num_tokens) <= self.free_blocks

    def ensure(self, rid: str, num_tokens: int) -> bool:
        """Grow `rid` to hold `num_tokens` tokens; False (and no change) when the pool is short."""
        need = self.blocks_needed(rid, num_tokens)
        if need > len(self._free):
            return False
        table = self.tables.setdefault(rid, [])
        for _ in range(need):
            table.append(self._free.pop())
        self._used += need
        return True

    def grow(self, rid: str, num_tokens: int) -> dict:
        """`ensure`, for the planner: the plan entry's `new_blocks` (raises when the pool is short: check first)."""
        before = len(self.tables.get(rid, ()))
        if not self.ensure(rid, num_tokens):
            raise RuntimeError(f"request {rid}: the pool cannot hold {num_tokens} tokens (caller checks first)")
        return {"new_blocks": self.tables[rid][before:]}

    def assign(self, rid: str, blocks: list[int]) -> None:
        """Follow stage 0's allocation (non-first stages)."""
        self.tables.setdefault(rid, []).extend(blocks)
        self._used += len(blocks)

    def free(self, rid: str) -> None:
        table = self.tables.pop(rid, [])
        self._used -= len(table)
        if not self.follower:
            self._free.extend(reversed(table))

    def slots(self, rid: str, start: int, end: int) -> torch.Tensor:
        """Cache slot of each position in `[start, end)`."""
        table = torch.tensor(self.tables[rid], dtype=torch.long)
        pos = torch.arange(start, end)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def padded_blocks(self, rids: list[str], lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """`[B, nblk]` blocks holding positions `0..len-1` per request (padding points at block 0) and the
        `[B, nblk * block_size]` mask of the positions that are real."""
        nblk = -(-max(lengths) // self.block_size)
        tables = torch.zeros(len(rids), nblk, dtype=torch.long)
        for i, (rid, n) in enumerate(zip(rids, lengths, strict=True)):
            t = self.tables[rid][: -(-n // self.block_size)]
            tables[i, : len(t)] = torch.tensor(t, dtype=torch.long)
        pos = torch.arange(nblk * self.block_size)
        mask = pos.unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
        return tables, mask


def kv_bytes_per_token(cfg: ModelConfig, num_layers: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_kv_heads * cfg.head_dim * elem * num_layers


def blocks_for_memory(
    cfg: ModelConfig, num_layers: int, dtype: torch.dtype, nbytes: int, block_size: int
) -> int:
    return nbytes // (kv_bytes_per_token(cfg, num_layers, dtype) * block_size)


class KVPool:
    """The cache tensors of one stage's own layers: `[num_blocks * block_size, kv_heads, head_dim]` each."""

    def __init__(
        self, cfg: ModelConfig, num_layers: int, num_blocks: int, block_size: int, dtype, device
    ) -> None:
        shape = (num_blocks * block_size, cfg.num_kv_heads, cfg.head_dim)
        self.caches = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(num_layers)
        ]
        self.nbytes = sum(k.numel() * k.element_size() * 2 for k, _ in self.caches)
