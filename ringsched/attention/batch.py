"""Turn a batch plan into the tensors a forward pass needs (identically on every stage)."""

from __future__ import annotations

import dataclasses

import torch

from ringsched.attention.paged import DecodeGroup, ForwardBatch, PagedSeqs, PrefillSeq
from ringsched.comm.messages import BatchPlan
from ringsched.kernels.native import NativeDecode
from ringsched.kv.cache import BlockTable
from ringsched.kv.ring import RingTable

# A decode joins the current length group while its context is at least this share of the group's longest:
# padding stays under ~40% of what the group reads, and a step has only a few groups.
GROUP_SHARE = 0.6
# On CPU a decode group holds at most this many requests: their gathered K/V (32 x 256 tokens x 3 KV heads x
# 64 x 4 bytes = 6 MiB for SmolLM2) then stays in a core's L2/L3 between the gather and the attention that
# reads it. Measured with 128 decodes at context <= 256, one thread: 14.3 ms per layer in one group, 10.9 ms
# in groups of 32, 12.1 in groups of 64. GPUs want the one big group.
CPU_GROUP_ROWS = 32


def on_device(
    data: list[int] | torch.Tensor, device: torch.device | str, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Host data (a list or a CPU tensor) as a tensor on `device`. To a GPU it goes through pinned memory as a
    non-blocking copy: queued on the stream behind the work already there instead of holding the host until the
    GPU is idle, so the next micro-batch's metadata is built while this one runs (torch's pinned allocator keeps
    the host buffer until its copy is done). On CPU the tensor is returned as it is."""
    t = data if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype)
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    if torch.device(device).type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def build_forward_batch(
    plan: BatchPlan, blocks: BlockTable, device: torch.device, native: bool = False
) -> tuple[ForwardBatch, torch.Tensor]:
    """Returns the batch description and the flattened input ids `[T]` (used by the first stage only).
    `native`: describe the decodes for the CPU kernel (`kernels/native.py`) rather than as padded groups."""
    batch, ids, decs, chunks = _flatten(plan, blocks, device)
    batch.prefills = [PrefillSeq(row, n, on_device(blocks.slots(rid, 0, ctx), device)) for row, rid, ctx, n in chunks]
    if decs:
        rows, rids, lens = (list(x) for x in zip(*decs, strict=True))
        if native:
            tables, _ = blocks.padded_blocks(rids, lens)
            batch.native_decode = NativeDecode(
                torch.tensor(rows, dtype=torch.long),
                tables.contiguous(),
                torch.tensor(lens),
                blocks.block_size,
                max(lens),
                all_rows=len(rows) == batch.num_tokens,
            )
        else:
            batch.decodes = _decode_groups(rows, rids, lens, blocks, device)
    batch.sliding = blocks.sliding_view(lambda ring: _sliding(batch, plan, ring, decs, chunks, device, native))
    return batch, ids


def build_paged_batch(plan: BatchPlan, blocks: BlockTable, device: torch.device) -> tuple[ForwardBatch, torch.Tensor]:
    """`build_forward_batch` for the Triton kernels: the decodes and the prefill chunks each as block tables and
    lengths (`PagedSeqs`), read in place by the kernels; no padded gathers, no per-chunk slot lists."""
    batch, ids, decs, chunks = _flatten(plan, blocks, device)
    batch.block_size = blocks.block_size
    if decs:
        batch.paged_decodes = _paged([d[0] for d in decs], [d[1] for d in decs], [d[2] for d in decs], blocks, device)
        batch.paged_decodes.all_rows = len(decs) == batch.num_tokens
    if chunks:
        batch.paged_extends = _paged(
            [x[0] for x in chunks], [x[1] for x in chunks], [x[2] for x in chunks], blocks, device
        )
        batch.paged_extends.q_lens = on_device([x[3] for x in chunks], device, torch.int32)
        batch.paged_extends.max_q_len = max(x[3] for x in chunks)
    # sliding layers attend per sequence (`WindowedAttention`), over their rings
    batch.sliding = blocks.sliding_view(lambda ring: _sliding(batch, plan, ring, decs, chunks, device, native=False))
    return batch, ids


def _sliding(
    batch: ForwardBatch, plan: BatchPlan, ring: RingTable, decs: list, chunks: list, device, native: bool
) -> ForwardBatch:
    """`batch` as the sliding layers read it (`ForwardBatch.sliding`): new tokens' slots, contexts (their windows)
    and CPU-kernel decodes in the requests' rings."""
    slots = torch.cat([ring.slots(e.rid, e.start, e.start + len(e.token_ids)) for e in plan.entries])
    view = dataclasses.replace(
        batch,
        slot_mapping=on_device(slots, device),
        decodes=[],
        native_decode=None,
        prefills=[],
        paged_decodes=None,
        paged_extends=None,
        sliding=None,
    )
    view.contexts = _contexts(decs, chunks, ring.window_slots, device)
    if native and decs:
        rows, rids, lens = (list(x) for x in zip(*decs, strict=True))
        view.native_decode = NativeDecode(
            torch.tensor(rows, dtype=torch.long),
            ring.block_tables(rids, lens),
            torch.tensor(lens),
            ring.block_size,
            max(lens),
            all_rows=len(rows) == batch.num_tokens,
        )
    return view


def _flatten(plan: BatchPlan, blocks: BlockTable, device) -> tuple[ForwardBatch, torch.Tensor, list, list]:
    """What every backend's batch shares: positions, sampled rows and new tokens' slots, the input ids; and the
    entries split into decodes `(row, rid, context length)` and prefill chunks `(first row, rid, context length,
    new tokens)`."""
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    logit_rows: list[int] = []
    decs: list[tuple[int, str, int]] = []
    chunks: list[tuple[int, str, int, int]] = []
    row = 0
    for e in plan.entries:
        n = len(e.token_ids)
        ids += e.token_ids
        positions += range(e.start, e.start + n)
        slots += blocks.slot_list(e.rid, e.start, e.start + n)
        if n == 1:
            decs.append((row, e.rid, e.start + 1))
        else:
            chunks.append((row, e.rid, e.start + n, n))
        logit_rows.extend(range(row, row + len(e.scored_ids)))  # prompt positions it scores (`stage/scored_rows.py`)
        if e.samples:  # its last token's row, and with drafts those of the tokens before them too
            logit_rows.extend(range(row + n - 1 - e.drafts, row + n))
        row += n
    batch = ForwardBatch(
        positions=on_device(positions, device, torch.long),
        logit_rows=on_device(logit_rows, device, torch.long),
        slot_mapping=on_device(slots, device, torch.long),
        position_bound=max((e.start + len(e.token_ids) - 1 for e in plan.entries), default=-1),
        samples_all=len(logit_rows) == row,  # rows are appended in order, each once: then they are all of them
    )
    batch.contexts = _contexts(decs, chunks, lambda rid, ctx, n: blocks.slots(rid, 0, ctx), device)
    return batch, on_device(ids, device, torch.long), decs, chunks


def _contexts(decs: list[tuple[int, str, int]], chunks: list[tuple[int, str, int, int]], slots_of, device):
    """`ForwardBatch.contexts`: the sequences' context slots (`slots_of(rid, context length, new tokens)`), looked up
    once, on the first call (a step of a model without sliding or soft-capped layers never calls it, and pays
    nothing)."""
    made: list = []

    def contexts() -> list[tuple[int, int, int, torch.Tensor]]:
        if not made:
            seqs = [(row, rid, ctx, 1) for row, rid, ctx in decs] + chunks
            made.extend((row, n, ctx, on_device(slots_of(rid, ctx, n), device)) for row, rid, ctx, n in seqs)
        return made

    return contexts


def _paged(rows: list[int], rids: list[str], lens: list[int], blocks: BlockTable, device) -> PagedSeqs:
    tables, _ = blocks.padded_blocks(rids, lens)
    return PagedSeqs(
        rows=on_device(rows, device, torch.long),
        tables=on_device(tables, device, torch.int32),
        kv_lens=on_device(lens, device, torch.int32),
        max_kv_len=max(lens),
    )


def _decode_groups(rows: list[int], rids: list[str], lens: list[int], blocks: BlockTable, device) -> list[DecodeGroup]:
    order = sorted(range(len(rows)), key=lambda i: -lens[i])
    cap = CPU_GROUP_ROWS if torch.device(device).type == "cpu" else len(rows)
    groups: list[list[int]] = []
    for i in order:
        if groups and len(groups[-1]) < cap and lens[i] >= GROUP_SHARE * lens[groups[-1][0]]:
            groups[-1].append(i)
        else:
            groups.append([i])
    out = []
    for g in groups:
        table, mask = blocks.padded_blocks([rids[i] for i in g], [lens[i] for i in g])
        out.append(
            DecodeGroup(
                rows=on_device([rows[i] for i in g], device, torch.long),
                blocks=on_device(table.reshape(-1), device),
                mask=on_device(mask[:, None, None, :], device),
                max_len=mask.shape[1],
            )
        )
    return out
