"""Turn a batch plan into the tensors a forward pass needs (identically on every stage)."""

from __future__ import annotations

import torch

from ringsched.comm.messages import BatchPlan
from ringsched.kv.cache import BlockTable
from ringsched.models.attention import DecodeGroup, ForwardBatch, PagedSeqs, PrefillSeq
from ringsched.models.native import NativeDecode

# A decode joins the current length group while its context is at least this share of the group's longest:
# padding stays under ~40% of what the group reads, and a step has only a few groups.
GROUP_SHARE = 0.6
# On CPU a decode group holds at most this many requests: their gathered K/V (32 x 256 tokens x 3 KV heads x
# 64 x 4 bytes = 6 MiB for SmolLM2) then stays in a core's L2/L3 between the gather and the attention that
# reads it. Measured with 128 decodes at context <= 256, one thread: 14.3 ms per layer in one group, 10.9 ms
# in groups of 32, 12.1 in groups of 64. GPUs want the one big group.
CPU_GROUP_ROWS = 32


def build_forward_batch(
    plan: BatchPlan, blocks: BlockTable, device: torch.device, native: bool = False
) -> tuple[ForwardBatch, torch.Tensor]:
    """Returns the batch description and the flattened input ids `[T]` (used by the first stage only).
    `native`: describe the decodes for the CPU kernel (`models/native.py`) rather than as padded groups."""
    ids: list[int] = []
    positions: list[int] = []
    slot_parts: list[torch.Tensor] = []
    logit_rows: list[int] = []
    dec_rows, dec_rids, dec_lens = [], [], []
    prefills: list[PrefillSeq] = []
    row = 0
    for e in plan.entries:
        n = len(e.token_ids)
        ids += e.token_ids
        positions += range(e.start, e.start + n)
        slot_parts.append(blocks.slots(e.rid, e.start, e.start + n))
        if n == 1:
            dec_rows.append(row)
            dec_rids.append(e.rid)
            dec_lens.append(e.start + 1)
        else:
            ctx = blocks.slots(e.rid, 0, e.start + n).to(device)
            prefills.append(PrefillSeq(row, n, ctx))
        if e.samples:
            logit_rows.append(row + n - 1)
        row += n
    batch = ForwardBatch(
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        logit_rows=torch.tensor(logit_rows, dtype=torch.long, device=device),
        slot_mapping=torch.cat(slot_parts).to(device),
        prefills=prefills,
    )
    if native and dec_rows:
        tables, _ = blocks.padded_blocks(dec_rids, dec_lens)
        batch.native_decode = NativeDecode(
            torch.tensor(dec_rows, dtype=torch.long),
            tables.contiguous(),
            torch.tensor(dec_lens),
            blocks.block_size,
            max(dec_lens),
            all_rows=len(dec_rows) == row,
        )
    elif dec_rows:
        batch.decodes = _decode_groups(dec_rows, dec_rids, dec_lens, blocks, device)
    return batch, torch.tensor(ids, dtype=torch.long, device=device)


def build_paged_batch(plan: BatchPlan, blocks: BlockTable, device: torch.device) -> tuple[ForwardBatch, torch.Tensor]:
    """`build_forward_batch` for the Triton kernels: the decodes and the prefill chunks each as block tables and
    lengths (`PagedSeqs`), read in place by the kernels; no padded gathers, no per-chunk slot lists."""
    ids: list[int] = []
    positions: list[int] = []
    slot_parts: list[torch.Tensor] = []
    logit_rows: list[int] = []
    dec: list[tuple[int, str, int]] = []  # (row, rid, context length)
    ext: list[tuple[int, str, int, int]] = []  # (first row, rid, context length, new tokens)
    row = 0
    for e in plan.entries:
        n = len(e.token_ids)
        ids += e.token_ids
        positions += range(e.start, e.start + n)
        slot_parts.append(blocks.slots(e.rid, e.start, e.start + n))
        if n == 1:
            dec.append((row, e.rid, e.start + 1))
        else:
            ext.append((row, e.rid, e.start + n, n))
        if e.samples:
            logit_rows.append(row + n - 1)
        row += n
    batch = ForwardBatch(
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        logit_rows=torch.tensor(logit_rows, dtype=torch.long, device=device),
        slot_mapping=torch.cat(slot_parts).to(device),
        block_size=blocks.block_size,
    )
    if dec:
        batch.paged_decodes = _paged([r for r, *_ in dec], [d[1] for d in dec], [d[2] for d in dec], blocks, device)
        batch.paged_decodes.all_rows = len(dec) == row
    if ext:
        batch.paged_extends = _paged([r for r, *_ in ext], [x[1] for x in ext], [x[2] for x in ext], blocks, device)
        batch.paged_extends.q_lens = torch.tensor([x[3] for x in ext], dtype=torch.int32, device=device)
        batch.paged_extends.max_q_len = max(x[3] for x in ext)
    return batch, torch.tensor(ids, dtype=torch.long, device=device)


def _paged(rows: list[int], rids: list[str], lens: list[int], blocks: BlockTable, device) -> PagedSeqs:
    tables, _ = blocks.padded_blocks(rids, lens)
    return PagedSeqs(
        rows=torch.tensor(rows, dtype=torch.long, device=device),
        tables=tables.to(device=device, dtype=torch.int32),
        kv_lens=torch.tensor(lens, dtype=torch.int32, device=device),
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
                rows=torch.tensor([rows[i] for i in g], dtype=torch.long, device=device),
                blocks=table.reshape(-1).to(device),
                mask=mask[:, None, None, :].to(device),
                max_len=mask.shape[1],
            )
        )
    return out
