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

from ringsched.comm.messages import BatchPlan
from ringsched.kv_cache import BlockTable
from ringsched.models.attention import ForwardBatch
from ringsched.parallel.cp import attend_block, merge_all, zigzag_pieces
from ringsched.parallel.cp_blocks import CPPlacement, is_split
from ringsched.parallel.cp_group import CPGroup


def partial_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                      k_pos: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Causal attention of `q` `[n, H, D]` at `q_pos` over keys `[m, KVH, D]` at `k_pos`: the output over these
    keys alone `[n, H, D]` and each row's LSE `[n, H]` (float32; -inf, with output 0, where no key is visible)."""
    n, h, d = q.shape
    m = k.shape[0]
    if m == 0 or n == 0 or int(k_pos.min()) > int(q_pos.max()):
        return q.new_zeros(n, h, d), torch.full((n, h), float("-inf"), device=q.device)
    if q.device.type != "cpu":
        return attend_block(q, k, v, q_pos, k_pos, scale)
    kvh = k.shape[1]
    g = h // kvh
    visible = None
    mask = None
    if int(k_pos.max()) > int(q_pos.min()):  # some key lies after some query
        visible = k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)  # [n, m]
        mask = torch.zeros(n, m, dtype=q.dtype).masked_fill_(~visible, float("-inf")).repeat(g, 1)
    # Grouped-query heads folded into the query length: [1, KVH, g * n, D] against [1, KVH, m, D].
    qf = q.view(n, kvh, g, d).permute(1, 2, 0, 3).reshape(1, kvh, g * n, d)
    kf, vf = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        qf, kf, vf, 0.0, False, attn_mask=mask, scale=scale
    )
    out = out.view(kvh, g, n, d).permute(2, 0, 1, 3).reshape(n, h, d)
    lse = lse.view(kvh, g, n).permute(2, 0, 1).reshape(n, h)
    if visible is not None:
        dead = ~visible.any(dim=1)
        if bool(dead.any()):
            lse[dead] = float("-inf")
            out[dead] = 0
    return out, lse


@dataclass
class RingEntry:
    rows: slice  # this rank's rows of the entry in the local batch
    q_pos: torch.Tensor  # their positions
    own_slots: torch.Tensor  # this rank's cache slots of every token it stores for the request (this chunk's too)
    k_pos: list[torch.Tensor]  # per CP rank: the positions it stores for the request
    new: list[int]  # per CP rank: how many of those are this chunk's (the last ones)


@dataclass
class TravelEntry:
    glob: slice  # the entry's rows in the group-wide query buffer
    local: slice | None  # its rows in the local batch, on the rank that owns it
    q_pos: torch.Tensor
    own_slots: torch.Tensor  # this rank's slots of the request's tokens (maybe none)
    own_pos: torch.Tensor


@dataclass
class CPForward:
    """One micro-batch as one CP rank runs it; `ForwardBatch.cp` of its batch (`attend` replaces paged attention)."""

    group: CPGroup
    ring: list[RingEntry] = field(default_factory=list)
    travel: list[TravelEntry] = field(default_factory=list)
    travel_rows: int = 0  # queries in the group-wide buffer
    num_samples: int = 0  # sampling rows of the whole micro-batch
    sample_index: list[int] = field(default_factory=list)  # each local sampling row's index among them

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
               kv: tuple[torch.Tensor, torch.Tensor], scale: float) -> torch.Tensor:  # fmt: skip
        """This rank's attention output `[T_local, H, D]`; writes its new K/V into its cache first."""
        k_cache, v_cache = kv
        k_cache.index_copy_(0, slots, k)
        v_cache.index_copy_(0, slots, v)
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
        o = torch.empty_like(everyone)
        lse = torch.empty(everyone.shape[:2], dtype=torch.float32, device=q.device)
        for e in self.travel:
            o[e.glob], lse[e.glob] = partial_attention(everyone[e.glob], k_cache[e.own_slots], v_cache[e.own_slots],
                                                       e.q_pos, e.own_pos, scale)  # fmt: skip
        outs, lses = self.group.all_gather(o), self.group.all_gather(lse)
        merged, _ = merge_all(list(outs.unbind(0)), list(lses.unbind(0)))
        for e in self.travel:
            if e.local is not None:
                out[e.local] = merged[e.glob]

    def _ring(self, q, k_cache, v_cache, scale: float, out: torch.Tensor) -> None:
        g, size = self.group, self.group.size
        # This rank's K/V of every ring entry, one `[m, 2, KVH, D]` block: what it sends first.
        held = torch.cat([torch.stack((k_cache[e.own_slots], v_cache[e.own_slots]), dim=1) for e in self.ring])
        parts: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in self.ring]
        for step in range(size):
            src = (g.rank - step) % size  # whose K/V this rank holds at this step
            pending = None
            if step < size - 1:
                incoming = (g.rank - step - 1) % size
                m = sum(int(e.k_pos[incoming].numel()) for e in self.ring)
                pending = g.exchange(held, (m, *held.shape[1:]))
            at = 0
            for e, acc in zip(self.ring, parts, strict=True):
                kpos = e.k_pos[src]
                block = held[at : at + kpos.numel()]
                at += kpos.numel()
                past = kpos.numel() - e.new[src]  # earlier chunks' keys: all before every query here
                qe = q[e.rows]
                for sl in (slice(0, past), slice(past, kpos.numel())):
                    if sl.stop > sl.start:
                        acc.append(partial_attention(qe, block[sl, 0], block[sl, 1], e.q_pos, kpos[sl], scale))
            if pending is not None:
                held = pending()
        for e, acc in zip(self.ring, parts, strict=True):
            o, _ = merge_all([a[0] for a in acc], [a[1] for a in acc])
            out[e.rows] = o

    def gather_samples(self, hidden: torch.Tensor) -> torch.Tensor:
        """The last stage: the micro-batch's sampling rows `[S, hidden]` (in plan order) on every CP rank, from
        each rank's own `[S_local, hidden]`."""
        full = hidden.new_zeros(self.num_samples, hidden.shape[-1])
        if self.sample_index:
            full[torch.tensor(self.sample_index, device=hidden.device)] = hidden
        return self.group.all_reduce(full)


def build_cp_batch(plan: BatchPlan, placement: CPPlacement, blocks: BlockTable, group: CPGroup,
                   device: torch.device) -> tuple[ForwardBatch, torch.Tensor]:  # fmt: skip
    """This rank's `ForwardBatch` (its rows only; `cp` set) and input ids for `plan`, the placement already
    applied."""
    r, size = group.rank, group.size
    cp = CPForward(group)
    ids: list[int] = []
    positions, slot_parts, logit_rows = [], [], []
    row = 0
    for e in plan.entries:
        n = len(e.token_ids)
        pieces = zigzag_pieces(e.cp_counts)
        mine = pieces[r]
        k = int(mine.numel())
        have = placement.count(e.rid, r)
        if k:
            ids += [e.token_ids[i] for i in mine.tolist()]
            positions.append(mine + e.start)
            slot_parts.append(blocks.slots(e.rid, have - k, have))
        own_slots = blocks.slots(e.rid, 0, have) if have else torch.empty(0, dtype=torch.long)
        if is_split(e.cp_counts):
            cp.ring.append(RingEntry(slice(row, row + k), mine + e.start, own_slots.to(device),
                                     [placement.positions(e.rid, j) for j in range(size)], list(e.cp_counts)))
        else:
            cp.travel.append(TravelEntry(slice(cp.travel_rows, cp.travel_rows + n), slice(row, row + k) if k else None,
                                         torch.arange(e.start, e.start + n), own_slots.to(device),
                                         placement.positions(e.rid, r)))  # fmt: skip
            cp.travel_rows += n
        if e.samples:
            last = next(j for j, p in enumerate(pieces) if p.numel() and int(p[-1]) == n - 1)
            if last == r:
                logit_rows.append(row + k - 1)  # a piece ends with its highest offset
                cp.sample_index.append(cp.num_samples)
            cp.num_samples += 1
        row += k
    batch = ForwardBatch(
        positions=torch.cat(positions).to(device) if positions else torch.empty(0, dtype=torch.long, device=device),
        logit_rows=torch.tensor(logit_rows, dtype=torch.long, device=device),
        slot_mapping=(torch.cat(slot_parts) if slot_parts else torch.empty(0, dtype=torch.long)).to(device),
        cp=cp,
    )
    return batch, torch.tensor(ids, dtype=torch.long, device=device)
