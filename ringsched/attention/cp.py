"""A micro-batch on one rank of a context-parallel group: the rows it computes, and attention over a KV split
across the group.

Every CP rank of a stage computes only its own rows of the micro-batch (embedding, projections, MLP), the
tokens the plan placed on it (`cp_counts`, see `cp_blocks.py`), and stores their K/V in its own pool. Attention
needs every key of a request, wherever it is stored, and takes one of two ways per plan entry:

- **ring** (an entry split over the ranks, a prefill chunk of at least 2 x cp_size tokens): each rank's K/V of
  the request (its earlier tokens and its part of this chunk) goes round the ring, the next exchange posted
  before the block in hand is attended, and each rank's queries merge their partial attention over every
  block by log-sum-exp (`cp.merge_all`);
- **queries travel** (an entry on one rank: a decode token, a short chunk): the queries are summed into a
  buffer every rank holds (the others' rows are zeros, so the sum is exact), each rank attends them over its
  own K/V of the request, the partial outputs and LSEs are all-gathered and merged, and the owner keeps its
  rows. Each rank reads only its share of the request's KV.

Partial attention runs torch's CPU flash kernel (it returns each row's LSE) with grouped-query heads folded
into the query length; rows that see no key get LSE -inf (the kernel gives 0) so they weigh nothing in the merge.
The last stage gathers its sampling rows to the group's first rank, which alone runs the lm_head and samples.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ringsched.attention.paged import ForwardBatch
from ringsched.attention.ring import attend_block, merge_all
from ringsched.comm.cp_group import CPGroup
from ringsched.kernels import native
from ringsched.kernels.native import NativeDecode


@dataclass
class Visibility:
    """Which keys at `k_pos` the queries at `q_pos` see (causal), as the flash kernel takes it: `none` (no key
    is visible: no attention to run), or an additive mask `[g * n, m]` for `g` query heads per KV head (None:
    every key is visible) and the rows that see no key. The same for every layer of a micro-batch."""

    none: bool = False
    mask: torch.Tensor | None = None
    dead: torch.Tensor | None = None

    @classmethod
    def of(cls, q_pos: torch.Tensor, k_pos: torch.Tensor, group: int, dtype: torch.dtype) -> Visibility:
        if q_pos.numel() == 0 or k_pos.numel() == 0 or int(k_pos.min()) > int(q_pos.max()):
            return cls(none=True)
        if int(k_pos.max()) <= int(q_pos.min()):
            return cls()
        visible = k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)  # [n, m]
        mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
        mask = mask.masked_fill_(~visible, float("-inf")).repeat(group, 1)
        dead = ~visible.any(dim=1)
        return cls(mask=mask, dead=dead if bool(dead.any()) else None)


def partial_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    scale: float,
    vis: Visibility | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of `q` `[n, H, D]` at `q_pos` over keys `[m, KVH, D]` at `k_pos`: the output over these
    keys alone `[n, H, D]` and each row's LSE `[n, H]` (float32; -inf, with output 0, where no key is visible).
    `vis`: their `Visibility`, when the caller keeps it between layers."""
    n, h, d = q.shape
    kvh = k.shape[1]
    g = h // kvh
    if q.device.type != "cpu":
        return _attend_in_key_chunks(q, k, v, q_pos, k_pos, scale)
    vis = vis or Visibility.of(q_pos, k_pos, g, q.dtype)
    if vis.none:
        return q.new_zeros(n, h, d), torch.full((n, h), float("-inf"), device=q.device)
    # Grouped-query heads folded into the query length: [1, KVH, g * n, D] against [1, KVH, m, D].
    qf = q.view(n, kvh, g, d).permute(1, 2, 0, 3).reshape(1, kvh, g * n, d)
    kf, vf = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        qf, kf, vf, 0.0, False, attn_mask=vis.mask, scale=scale
    )
    out = out.view(kvh, g, n, d).permute(2, 0, 1, 3).reshape(n, h, d)
    lse = lse.view(kvh, g, n).permute(2, 0, 1).reshape(n, h)
    if vis.dead is not None:  # the kernel gives those rows LSE 0
        lse[vis.dead] = float("-inf")
        out[vis.dead] = 0
    return out, lse


KEY_CHUNK = 4096  # keys per step of the GPU path: its `[heads, n, keys]` float32 scores stay bounded


def _attend_in_key_chunks(q, k, v, q_pos, k_pos, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Off the CPU: `cp.attend_block` over at most `KEY_CHUNK` keys at a time, merged by LSE."""
    if k.shape[0] == 0:
        return q.new_zeros(q.shape), torch.full(q.shape[:2], float("-inf"), device=q.device)
    parts = [
        attend_block(q, k[i : i + KEY_CHUNK], v[i : i + KEY_CHUNK], q_pos, k_pos[i : i + KEY_CHUNK], scale)
        for i in range(0, k.shape[0], KEY_CHUNK)
    ]
    return parts[0] if len(parts) == 1 else merge_all([o for o, _ in parts], [lse for _, lse in parts])


@dataclass
class RingEntry:
    rows: slice  # this rank's rows of the entry in the local batch
    q_pos: torch.Tensor  # their positions
    k_pos: list[torch.Tensor]  # per CP rank: the positions it stores for the request
    new: list[int]  # per CP rank: how many of those are this chunk's (the last ones)
    # per CP rank: the visibility of its earlier and of its new keys to this rank's queries (the first layer's)
    seen: dict[int, tuple[Visibility, Visibility]] = field(default_factory=dict)

    def visibility(self, src: int, group: int, dtype: torch.dtype) -> tuple[Visibility, Visibility]:
        if self.q_pos.device.type != "cpu":  # the GPU path masks as it goes
            return Visibility(), Visibility()
        if src not in self.seen:
            kpos = self.k_pos[src]
            past = kpos.numel() - self.new[src]
            self.seen[src] = (
                Visibility.of(self.q_pos, kpos[:past], group, dtype),
                Visibility.of(self.q_pos, kpos[past:], group, dtype),
            )
        return self.seen[src]


@dataclass
class TravelEntry:
    glob: slice  # the entry's rows in the group-wide query buffer
    local: slice | None  # its rows in the local batch, on the rank that owns it
    q_pos: torch.Tensor
    own_slots: torch.Tensor  # this rank's slots of the request's tokens (maybe none)
    own_pos: torch.Tensor
    by_kernel: bool = False  # a decode attended by the CPU decode kernel (`CPForward.decodes`), in place


@dataclass
class CPForward:
    """One micro-batch as one CP rank runs it: its batch's `attend` and `gather_samples` (`attention/cp_backend.py`)."""

    group: CPGroup
    ring: list[RingEntry] = field(default_factory=list)
    ring_slots: torch.Tensor | None = None  # this rank's slots of every ring entry's tokens, entry after entry
    travel: list[TravelEntry] = field(default_factory=list)
    travel_rows: int = 0  # queries in the group-wide buffer
    decodes: NativeDecode | None = None  # the decodes this rank holds KV of, for the CPU kernel (rows: buffer rows)
    num_samples: int = 0  # sampling rows of the whole micro-batch
    sample_index: list[int] = field(default_factory=list)  # each local sampling row's index among them

    def attend(
        self, q: torch.Tensor, batch: ForwardBatch, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """`ForwardBatch.attend` of a CP batch: this rank's attention output `[T_local, H, D]` over the group's K/V
        (this rank's new K/V already in its cache)."""
        out = torch.empty_like(q)
        if self.travel_rows:
            self._travelling_queries(q, k_cache, v_cache, scale, out)
        if self.ring:
            self._ring(q, k_cache, v_cache, scale, out)
        return out

    def _travelling_queries(self, q, k_cache, v_cache, scale: float, out: torch.Tensor) -> None:
        everyone = q.new_zeros(self.travel_rows, *q.shape[1:])
        for e in self.travel:
            if e.local is not None:
                everyone[e.glob] = q[e.local]
        self.group.all_reduce(everyone)  # one rank's rows each, the rest zeros: the sum is exact
        o = torch.zeros_like(everyone)  # rows this rank holds no key of: output 0, LSE -inf
        lse = torch.full(everyone.shape[:2], float("-inf"), device=q.device)
        if self.decodes is not None:  # read in place, each request's own blocks (no gathered copy)
            nd = self.decodes
            part = torch.empty(nd.rows.numel(), everyone.shape[1], dtype=torch.float32)
            o[nd.rows] = native.paged_decode(everyone.index_select(0, nd.rows), k_cache, v_cache, nd, scale, part)
            lse[nd.rows] = part
        for e in self.travel:
            if e.by_kernel:
                continue
            o[e.glob], lse[e.glob] = partial_attention(
                everyone[e.glob], k_cache[e.own_slots], v_cache[e.own_slots], e.q_pos, e.own_pos, scale
            )
        outs, lses = self.group.all_gather(o), self.group.all_gather(lse)
        merged, _ = merge_all(list(outs.unbind(0)), list(lses.unbind(0)))
        for e in self.travel:
            if e.local is not None:
                out[e.local] = merged[e.glob]

    def _ring(self, q, k_cache, v_cache, scale: float, out: torch.Tensor) -> None:
        g, size = self.group, self.group.size
        heads_per_kv = q.shape[1] // k_cache.shape[1]
        # This rank's K and V of every ring entry: what it sends first.
        held = [k_cache.index_select(0, self.ring_slots), v_cache.index_select(0, self.ring_slots)]
        parts: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in self.ring]
        for step in range(size):
            src = (g.rank - step) % size  # whose K/V this rank holds at this step
            pending = None
            if step < size - 1:
                incoming = (g.rank - step - 1) % size
                m = sum(int(e.k_pos[incoming].numel()) for e in self.ring)
                pending = g.exchange(held, (m, *held[0].shape[1:]))
            at = 0
            for e, acc in zip(self.ring, parts, strict=True):
                m = e.k_pos[src].numel()
                k, v, kpos = held[0][at : at + m], held[1][at : at + m], e.k_pos[src]
                at += m
                past = m - e.new[src]  # earlier chunks' keys come first, then this chunk's
                for sl, vis in zip(
                    (slice(0, past), slice(past, m)), e.visibility(src, heads_per_kv, q.dtype), strict=True
                ):
                    if not vis.none:
                        acc.append(partial_attention(q[e.rows], k[sl], v[sl], e.q_pos, kpos[sl], scale, vis))
            if pending is not None:
                held = pending()
        for e, acc in zip(self.ring, parts, strict=True):
            o, _ = merge_all([a[0] for a in acc], [a[1] for a in acc])
            out[e.rows] = o

    def sampled(self, held: list[int], row: int) -> list[int]:
        """An entry's sampling rows, `held[j]` the index of its j-th in this rank's piece (or -1: another rank's),
        the piece starting at buffer row `row`: the buffer rows this rank gives `gather_samples`."""
        rows = []
        for j, i in enumerate(held):
            if i >= 0:
                rows.append(row + i)
                self.sample_index.append(self.num_samples + j)
        self.num_samples += len(held)
        return rows

    def gather_samples(self, hidden: torch.Tensor) -> torch.Tensor:
        """The last stage: the micro-batch's sampling rows `[S, hidden]` (in plan order) on every CP rank, from
        each rank's own `[S_local, hidden]`."""
        full = hidden.new_zeros(self.num_samples, hidden.shape[-1])
        if self.sample_index:
            full[torch.tensor(self.sample_index, device=hidden.device)] = hidden
        return self.group.all_reduce(full)
