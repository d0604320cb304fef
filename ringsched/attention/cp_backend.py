"""Context parallelism as a stage's attention backend (`--cp-size > 1`): every CP rank of a stage computes its own rows
of each micro-batch and attends over the K/V the group holds between them (`attention/cp.py`).

The backend keeps where each request's tokens are on the group's ranks (`CPPlacement`, rebuilt from the plans on every
rank), builds this rank's rows of a micro-batch (`build_cp_batch`), and sets on the batch the CP attention and the
gather of the sampling rows to the group's first rank, which alone samples. The stage loop and the model never ask
whether they run under CP.
"""

from __future__ import annotations

import torch

from ringsched.attention.backend import AttentionBackend
from ringsched.attention.cp import CPForward, RingEntry, TravelEntry
from ringsched.attention.paged import ForwardBatch
from ringsched.comm.cp_group import CPGroup
from ringsched.comm.messages import BatchPlan, PlanEntry
from ringsched.kernels.native import NativeDecode
from ringsched.kv.cache import BlockTable
from ringsched.kv.cp_blocks import CPPlacement, is_split
from ringsched.layout.cp_split import zigzag_pieces


class CPBackend(AttentionBackend):
    """The attention of one rank of a stage's CP group; `native_decode`: decodes through the CPU decode kernel."""

    def __init__(self, group: CPGroup, native_decode: bool = False) -> None:
        super().__init__("cp", native_decode)
        self.group = group
        self.placement = CPPlacement(group.size)  # where each request's tokens are, per CP rank

    seam_from_plan = False  # a CP rank's seam holds its own share of the rows

    @property
    def samples_here(self) -> bool:
        return self.group.leads

    def apply(self, plan: BatchPlan) -> None:
        self.placement.apply(plan)

    def forward_batch(
        self, plan: BatchPlan, blocks: BlockTable, device: torch.device
    ) -> tuple[ForwardBatch, torch.Tensor]:
        return build_cp_batch(plan, self.placement, blocks, self.group, device, self.native_decode)

    def stats(self) -> dict:
        return self.group.stats()


def build_cp_batch(
    plan: BatchPlan,
    placement: CPPlacement,
    blocks: BlockTable,
    group: CPGroup,
    device: torch.device,
    use_kernel: bool = False,
) -> tuple[ForwardBatch, torch.Tensor]:
    """This rank's `ForwardBatch` (its rows only, attending through `CPForward`) and input ids for `plan`, the
    placement already applied. `use_kernel`: decodes attend through the CPU decode kernel (`kernels/native.py`)."""
    r, cp = group.rank, CPForward(group)
    ids: list[int] = []
    positions, slot_parts, logit_rows, ring_slots = [], [], [], []
    kernel_rows: list[tuple[int, str, int]] = []  # (buffer row, request, tokens this rank holds) per decode
    row = 0
    for e in plan.entries:
        n = len(e.token_ids)
        mine = zigzag_pieces(e.cp_counts)[r]
        k, have = int(mine.numel()), placement.count(e.rid, r)
        if k:
            ids += [e.token_ids[i] for i in mine.tolist()]
            positions.append(mine + e.start)
            slot_parts.append(blocks.slots(e.rid, have - k, have))
        by_kernel = use_kernel and n == 1 and not is_split(e.cp_counts)  # a decode: read in place by the kernel
        own_slots = blocks.slots(e.rid, 0, have) if have and not by_kernel else torch.empty(0, dtype=torch.long)
        if is_split(e.cp_counts):
            cp.ring.append(_ring_entry(e, slice(row, row + k), mine, placement, device))
            ring_slots.append(own_slots)
        else:
            if by_kernel and have:
                kernel_rows.append((cp.travel_rows, e.rid, have))
            cp.travel.append(_travel_entry(e, cp.travel_rows, row, k, own_slots, placement, r, by_kernel, device))
            cp.travel_rows += n
        if e.samples:  # its last offset, and a verified entry's `drafts` before it: each on the rank holding it
            logit_rows += cp.sampled(_held_samples(mine, n, e.drafts), row)
        row += k
    if ring_slots:
        cp.ring_slots = torch.cat(ring_slots).to(device)
    if kernel_rows:
        cp.decodes = _kernel_decodes(kernel_rows, blocks)
    empty = torch.empty(0, dtype=torch.long)
    batch = ForwardBatch(
        positions=(torch.cat(positions) if positions else empty).to(device),
        logit_rows=torch.tensor(logit_rows, dtype=torch.long, device=device),
        slot_mapping=(torch.cat(slot_parts) if slot_parts else empty).to(device),
        attend=cp.attend,
        gather_samples=cp.gather_samples,
    )
    return batch, torch.tensor(ids, dtype=torch.long, device=device)


def _ring_entry(e: PlanEntry, rows: slice, mine: torch.Tensor, placement: CPPlacement, device) -> RingEntry:
    """An entry split over the group: its keys go round the ring."""
    size = len(e.cp_counts)
    k_pos = [placement.positions(e.rid, j).to(device) for j in range(size)]
    return RingEntry(rows, (mine + e.start).to(device), k_pos, list(e.cp_counts))


def _travel_entry(
    e: PlanEntry,
    first: int,
    row: int,
    k: int,
    own_slots: torch.Tensor,
    placement: CPPlacement,
    rank: int,
    by_kernel: bool,
    device,
) -> TravelEntry:
    """An entry on one rank: its queries travel (buffer rows from `first`; this rank's `k` rows from `row`)."""
    n = len(e.token_ids)
    # (every key a rank holds of a decoding request is visible to its query: the kernel needs no positions)
    own_pos = torch.empty(0, dtype=torch.long) if by_kernel else placement.positions(e.rid, rank)
    return TravelEntry(
        slice(first, first + n),
        slice(row, row + k) if k else None,
        torch.arange(e.start, e.start + n, device=device),
        own_slots.to(device),
        own_pos.to(device),
        by_kernel,
    )


def _held_samples(mine: torch.Tensor, n: int, drafts: int) -> list[int]:
    """Where this rank's piece `mine` (offsets, increasing) of an `n`-token entry holds each of its sampled offsets
    `n - 1 - drafts .. n - 1`: the index in the piece, or -1 where another rank holds it. Being the entry's highest
    offsets, those held are among the piece's last `1 + drafts`."""
    tail = mine[-(1 + drafts) :].tolist()
    base = int(mine.numel()) - len(tail)
    return [base + tail.index(o) if o in tail else -1 for o in range(n - 1 - drafts, n)]


def _kernel_decodes(kernel_rows: list[tuple[int, str, int]], blocks: BlockTable) -> NativeDecode:
    """The decodes the CPU kernel reads in place: (buffer row, request, tokens this rank holds) each."""
    rows, rids, lens = zip(*kernel_rows, strict=True)
    tables, _ = blocks.padded_blocks(list(rids), list(lens))
    return NativeDecode(torch.tensor(rows), tables.contiguous(), torch.tensor(lens), blocks.block_size, max(lens))
