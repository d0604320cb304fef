"""Turn a batch plan into the tensors a forward pass needs (identically on every stage)."""

from __future__ import annotations

import torch

from ringsched.comm.messages import BatchPlan
from ringsched.kv_cache import BlockTable
from ringsched.models.attention import ForwardBatch, PrefillSeq


def build_forward_batch(
    plan: BatchPlan, blocks: BlockTable, device: torch.device
) -> tuple[ForwardBatch, torch.Tensor]:
    """Returns the batch description and the flattened input ids `[T]` (used by the first stage only)."""
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
    if dec_rows:
        slots, mask = blocks.padded_slots(dec_rids, dec_lens)
        batch.decode_rows = torch.tensor(dec_rows, dtype=torch.long, device=device)
        batch.decode_slots = slots.to(device)
        batch.decode_mask = mask[:, None, None, :].to(device)
    return batch, torch.tensor(ids, dtype=torch.long, device=device)
