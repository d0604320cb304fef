"""Paged KV cache: a block allocator (plain data) and the per-layer cache tensors of one stage.

Every stage has a `BlockTable` of the same capacity (the minimum over stages). Only stage 0 allocates: the
block numbers it picks travel in each plan entry (`new_blocks`) and the other stages `assign` them, so block
numbers agree on every stage without a second allocator that could drift.

Prefix caching lives in stage 0's table alone (`PrefixCache`): a request that starts from cached blocks gets
them in its first plan entry (`cached_blocks`), and the other stages `assign` them like new ones. No other stage
hashes, looks up or evicts, so no stage can see a different cached prefix than stage 0 planned with.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

import torch

if TYPE_CHECKING:
    from ringsched.comm.messages import PlanEntry
    from ringsched.weights.model_config import ModelConfig

T = TypeVar("T")
SLOTS_BY_LIST = 256  # `BlockTable.slots` of up to this many positions built as a list (fewer, smaller calls)


def block_hashes(ids: Sequence[int], block_size: int, have: list[bytes]) -> list[bytes]:
    """`have` (the chained hashes of the first full blocks of `ids`) extended to every full block of `ids`.

    A block's hash covers its token ids and, through its parent's hash, every token before it, so equal hashes
    mean equal prefixes (a 128-bit BLAKE2 digest: a collision, which would hand one request another's KV, cannot
    be crafted the way Python's `hash` of a tuple could)."""
    out = list(have)
    for i in range(len(out), len(ids) // block_size):
        parent = out[-1] if out else b""
        tokens = array("q", ids[i * block_size : (i + 1) * block_size]).tobytes()
        out.append(hashlib.blake2b(parent + tokens, digest_size=16).digest())
    return out


class PrefixCache:
    """Stage 0's index of full KV blocks by the hash of the prefix they end (`block_hashes`), and the blocks no
    request holds but that keep their KV for the next request with that prefix (`idle`, oldest first: evicted
    least recently used when the pool needs room)."""

    def __init__(self) -> None:
        self.block_of: dict[bytes, int] = {}
        self.hash_of: dict[int, bytes] = {}
        self.idle: OrderedDict[int, None] = OrderedDict()
        self.queries = 0  # prompt tokens looked up (each admission, re-admission after preemption included)
        self.hits = 0  # of which were found cached

    def lookup(self, hashes: list[bytes]) -> list[int]:
        """The blocks of the longest cached prefix among `hashes`."""
        blocks = []
        for h in hashes:
            b = self.block_of.get(h)
            if b is None:
                break
            blocks.append(b)
        return blocks

    def evict(self) -> int:
        """Forget the least recently used idle block; its number."""
        b, _ = self.idle.popitem(last=False)
        del self.block_of[self.hash_of.pop(b)]
        return b


class BlockTable:
    """Which blocks each request holds. Deterministic: the same calls give the same blocks.

    A block may be held by several requests (a shared prefix, `share`): each block counts its holders, and a
    block is in use while any request holds it. With a `PrefixCache` (stage 0 only), a full block is indexed by
    its prefix's hash once computed (`index`), and when its last holder frees it, it keeps its KV as an idle
    block: still free capacity, taken back by a request with the same prefix, or evicted when the pool has no
    never-used block left."""

    scores_prompts = True  # one rank computes every position of a chunk (`SamplingParams.prompt_logprobs`)

    def __init__(self, num_blocks: int, block_size: int, follower: bool = False, prefix_caching: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError("the KV pool holds no block; raise --kv-cache-memory")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.follower = follower  # takes its block numbers from plans (`assign`), never allocates
        self.cache = PrefixCache() if prefix_caching and not follower else None
        self._used = 0
        self._refs = [0] * num_blocks  # requests holding each block
        # Popped from the end: lowest block numbers first, and freed blocks are reused first.
        self._free = list(range(num_blocks - 1, -1, -1))
        self.tables: dict[str, list[int]] = {}
        self._cached: dict[str, int] = {}  # leading blocks of each request already indexed in the cache

    @property
    def capacity_tokens(self) -> int:
        """The most tokens one request can hold."""
        return self.num_blocks * self.block_size

    @property
    def free_blocks(self) -> int:
        """Blocks no request holds (idle cached blocks included: they are evicted on demand)."""
        return self.num_blocks - self._used

    @property
    def used_blocks(self) -> int:
        return self._used

    @property
    def cached_idle_blocks(self) -> int:
        return len(self.cache.idle) if self.cache else 0

    @property
    def usage(self) -> float:
        return self.used_blocks / self.num_blocks

    def blocks_needed(self, rid: str, num_tokens: int) -> int:
        have = len(self.tables.get(rid, ()))
        return max(-(-num_tokens // self.block_size) - have, 0)

    def can_hold(self, rid: str, num_tokens: int, shared: Sequence[int] = ()) -> bool:
        """Whether `rid`, after taking the cached blocks `shared` (`share`), can grow to `num_tokens` tokens."""
        have = len(self.tables.get(rid, ())) + len(shared)
        need = max(-(-num_tokens // self.block_size) - have, 0)
        taken_idle = sum(1 for b in shared if self._refs[b] == 0)  # idle now, held once shared
        return need + taken_idle <= self.free_blocks

    def _hold(self, b: int) -> None:
        if self._refs[b] == 0:
            self._used += 1
        self._refs[b] += 1

    def _take(self) -> int:
        b = self._free.pop() if self._free else self.cache.evict()
        self._hold(b)
        return b

    def ensure(self, rid: str, num_tokens: int) -> bool:
        """Grow `rid` to hold `num_tokens` tokens; False (and no change) when the pool is short."""
        need = self.blocks_needed(rid, num_tokens)
        if need > self.free_blocks:
            return False
        table = self.tables.setdefault(rid, [])
        for _ in range(need):
            table.append(self._take())
        return True

    def grow(self, rid: str, num_tokens: int) -> dict:
        """`ensure`, for the planner: the plan entry's `new_blocks` (raises when the pool is short: check first)."""
        before = len(self.tables.get(rid, ()))
        if not self.ensure(rid, num_tokens):
            raise RuntimeError(f"request {rid}: the pool cannot hold {num_tokens} tokens (caller checks first)")
        return {"new_blocks": self.tables[rid][before:]}

    def can_extend(self, e: PlanEntry, end: int) -> bool:
        """Whether entry `e` (its request's last) can grow to end at position `end` (drafts after its token)."""
        return self.can_hold(e.rid, end)

    def extend(self, e: PlanEntry, end: int) -> None:
        """Grow entry `e` to end at position `end`; its block fields take the new blocks."""
        grown = self.grow(e.rid, end)
        e.new_blocks = e.new_blocks + grown["new_blocks"]
        e.ring_blocks = e.ring_blocks + grown.get("ring_blocks", [])

    def rewind(self, rid: str, length: int) -> None:
        """`rid` keeps its first `length` positions. Nothing to do here: position p is in slot p of its blocks, so
        the request's next entry, starting at `length`, overwrites what follows (`CPBlocks` places by rank)."""

    def share(self, rid: str, blocks: Sequence[int]) -> None:
        """Start `rid` (holding nothing yet) from cached blocks: an idle one is held again, a held one shared."""
        assert rid not in self.tables, f"request {rid} already holds blocks"
        for b in blocks:
            if self._refs[b] == 0 and self.cache:
                self.cache.idle.pop(b)
            self._hold(b)
        self.tables[rid] = list(blocks)
        self._cached[rid] = len(blocks)

    def index(self, rid: str, hashes: list[bytes]) -> None:
        """Index `rid`'s leading full blocks, whose KV is computed (or being computed, by an earlier micro-batch
        than any that could read it), under their prefixes' `hashes`. A prefix cached in another block already
        keeps that block."""
        pc = self.cache
        for i in range(self._cached.get(rid, 0), len(hashes)):
            b = self.tables[rid][i]
            if hashes[i] not in pc.block_of and b not in pc.hash_of:
                pc.block_of[hashes[i]] = b
                pc.hash_of[b] = hashes[i]
        self._cached[rid] = max(self._cached.get(rid, 0), len(hashes))

    def indexed(self, rid: str) -> int:
        """How many of `rid`'s leading blocks are indexed (or were cached when it started from them)."""
        return self._cached.get(rid, 0)

    def follow(self, e: PlanEntry, cp_rank: int = 0) -> None:
        """Follow stage 0's allocation for plan entry `e` (the other ranks): a cached prefix first, then what the
        entry computes; under `--cp-size`, this CP rank's own blocks (assigned even when none, so the request is
        known)."""
        if e.cp_counts:
            self.assign(e.rid, e.cp_blocks[cp_rank])
        elif e.cached_blocks or e.new_blocks:
            self.assign(e.rid, e.cached_blocks + e.new_blocks)

    def assign(self, rid: str, blocks: list[int]) -> None:
        """Follow stage 0's allocation (non-first stages)."""
        self.tables.setdefault(rid, []).extend(blocks)
        for b in blocks:
            self._hold(b)

    def free(self, rid: str) -> None:
        """`rid` lets go of its blocks; one no one else holds becomes free, or idle if it is cached. The last
        block goes first: a request's tail is evicted before the prefix other requests are likelier to share."""
        self._cached.pop(rid, None)
        for b in reversed(self.tables.pop(rid, [])):
            self._refs[b] -= 1
            if self._refs[b]:
                continue
            self._used -= 1
            if self.follower:
                continue
            if self.cache and b in self.cache.hash_of:
                self.cache.idle[b] = None
            else:
                self._free.append(b)

    def slots(self, rid: str, start: int, end: int) -> torch.Tensor:
        """Cache slot of each position in `[start, end)`."""
        if end - start <= SLOTS_BY_LIST:
            return torch.tensor(self.slot_list(rid, start, end), dtype=torch.long)
        table = torch.tensor(self.tables[rid], dtype=torch.long)
        pos = torch.arange(start, end)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def slot_list(self, rid: str, start: int, end: int) -> list[int]:
        """`slots` as a list (what a step's batch gathers its new tokens' slots into: one tensor for them all)."""
        table, bs = self.tables[rid], self.block_size
        if end - start == 1:
            return [table[start // bs] * bs + start % bs]
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def sliding_view(self, make: Callable[..., T]) -> T | None:
        """What `make` builds of the sliding layers' rings, where this pool has them (`SlidingBlockTable`); None:
        every layer reads the main blocks."""
        return None

    def padded_blocks(self, rids: list[str], lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """`[B, nblk]` blocks holding positions `0..len-1` per request (padding points at block 0) and the
        `[B, nblk * block_size]` mask of the positions that are real. Built as lists, one tensor at the end: a
        step of many decodes pays a few list operations a request, not a tensor each."""
        bs = self.block_size
        counts = [-(-n // bs) for n in lengths]
        nblk = max(counts)
        rows = [self.tables[rid][:k] + [0] * (nblk - k) for rid, k in zip(rids, counts, strict=True)]
        tables = torch.tensor(rows, dtype=torch.long).view(len(rids), nblk)
        pos = torch.arange(nblk * bs)
        mask = pos.unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
        return tables, mask


def kv_bytes_per_token(cfg: ModelConfig, num_layers: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_kv_heads * cfg.head_dim * elem * num_layers


def blocks_for_memory(cfg: ModelConfig, num_layers: int, dtype: torch.dtype, nbytes: int, block_size: int) -> int:
    return nbytes // (kv_bytes_per_token(cfg, num_layers, dtype) * block_size)


class KVPool:
    """The cache tensors of one stage's own layers: `[num_blocks * block_size, kv_heads, head_dim]` each; a sliding
    layer's (`sliding[i]`) `[ring_blocks * block_size, ...]`, the sliding pool its requests' rings live in."""

    def __init__(
        self,
        cfg: ModelConfig,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        dtype,
        device,
        sliding: Sequence[bool] = (),
        ring_blocks: int = 0,
    ) -> None:
        def pair(blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
            shape = (blocks * block_size, cfg.num_kv_heads, cfg.head_dim)
            return torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)

        slides = list(sliding) + [False] * (num_layers - len(sliding))
        self.caches = [pair(ring_blocks if slides[i] else num_blocks) for i in range(num_layers)]
        self.nbytes = sum(k.numel() * k.element_size() * 2 for k, _ in self.caches)
