"""The log-sum-exp arithmetic of partial attention that context parallelism's ring attention is made of.

A block's output is a softmax over its keys only, and `merge` reweights two of them by their share of the
common denominator, so partial attentions of the same queries over disjoint key blocks combine into the whole.
A query row whose block is entirely in its future has no key at all: its partial output is 0 and its LSE -inf,
and the merge gives it weight 0 without computing `-inf - -inf`. `attention/cp.py` runs it across a
stage's CP ranks (`tests/cp_reference.py` holds the textbook ring the tests check it against).

Shapes: q `[n, heads, D]`, k and v `[m, kv_heads, D]` (grouped-query attention when kv_heads < heads),
positions `[n]` and `[m]` (int64), outputs `[n, heads, D]` and LSE `[n, heads]` (float32 for float32 inputs).
"""

from __future__ import annotations

import torch


def attend_block(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of queries at `q_pos` over one block of keys at `k_pos`: the block's softmax-normalised
    output and each row's LSE. Rows with no visible key give output 0 and LSE -inf."""
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads != kv_heads:
        k, v = (x.repeat_interleave(heads // kv_heads, dim=1) for x in (k, v))
    scores = torch.einsum("nhd,mhd->hnm", q.float(), k.float()) * scale  # [heads, n, m]
    visible = k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)  # [n, m]
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [heads, n]; -inf where nothing is visible
    probs = torch.exp(scores - lse.unsqueeze(-1).clamp_min(torch.finfo(scores.dtype).min))
    out = torch.einsum("hnm,mhd->nhd", probs, v.float())
    return out.to(q.dtype), lse.transpose(0, 1).contiguous()


def merge(
    o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial attentions of the same queries over disjoint keys, as one: LSE = log(e^LSE1 + e^LSE2),
    O = O1 e^(LSE1 - LSE) + O2 e^(LSE2 - LSE). A side with LSE -inf weighs 0; both -inf stay 0 and -inf."""
    return merge_all([o1, o2], [lse1, lse2])


def merge_all(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """`merge` of any number of partial attentions of the same queries over disjoint keys, in one pass:
    weights e^(LSE_i - LSE) with LSE = logsumexp_i LSE_i (rows seen by no part stay 0 and -inf)."""
    lse = torch.logsumexp(torch.stack(lses), dim=0)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    out = sum(o.float() * torch.exp(part - safe).unsqueeze(-1) for o, part in zip(outs, lses, strict=True))
    return out.to(outs[0].dtype), lse
