"""Prompt log-probabilities (`SamplingParams.prompt_logprobs`), packed for their way back to stage 0.

The last stage scores prompt positions as it computes them: for the row of position `p`, the log-probability and
rank of prompt token `p + 1` under the model's distribution there (log_softmax of the raw logits, as vLLM), and the
`k` most likely tokens. The values travel after the sampled tokens in the same int64 tensor, floats as their
float64 bits (as `sampler.logprob_values`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# A prompt token's log-probability, its rank (1: the most likely), and the top (id, log-probability)s
Scored = tuple[float, int, list[tuple[int, float]]]

ROWS_AT_ONCE = 256  # rows put through log_softmax together: the float32 copy of a long chunk's logits stays small


def score_values(logits: torch.Tensor, targets: torch.Tensor, ks: Sequence[int]) -> torch.Tensor:
    """Per row `i`: `targets[i]`'s log-probability and rank, then the `ks[i]` most likely ids and their
    log-probabilities, as one int64 tensor (`unpack_scores` reads it back)."""
    if not len(ks):
        return torch.empty(0, dtype=torch.int64)
    parts = []
    kmax = max(ks)
    for at in range(0, len(ks), ROWS_AT_ONCE):
        lp = torch.log_softmax(logits[at : at + ROWS_AT_ONCE].float(), dim=-1)
        own = targets[at : at + ROWS_AT_ONCE].to(lp.device)[:, None]
        chosen = lp.gather(1, own)
        rank = (lp > chosen).sum(dim=1) + 1
        top = lp.topk(kmax, dim=-1) if kmax else None
        chosen, rank = chosen[:, 0].double().cpu(), rank.cpu()
        ids, vals = (top.indices.cpu(), top.values.double().cpu()) if top is not None else (None, None)
        for j, k in enumerate(ks[at : at + ROWS_AT_ONCE]):
            parts += [chosen[j : j + 1].view(torch.int64), rank[j : j + 1]]
            if k:
                parts += [ids[j, :k], vals[j, :k].contiguous().view(torch.int64)]
    return torch.cat(parts)


def unpack_scores(values: Sequence[int], ks: Sequence[int]) -> list[Scored]:
    """`score_values`'s ints back to one `Scored` per row."""
    floats = torch.tensor(list(values), dtype=torch.int64).view(torch.float64).tolist()
    out, at = [], 0
    for k in ks:
        top = list(zip(values[at + 2 : at + 2 + k], floats[at + 2 + k : at + 2 + 2 * k], strict=True))
        out.append((floats[at], int(values[at + 1]), top))
        at += 2 + 2 * k
    return out


def score_width(ks: Sequence[int]) -> int:
    return sum(2 + 2 * k for k in ks)


def prompt_targets(prompt_ids: Sequence[int], start: int, n: int) -> list[int]:
    """The prompt tokens an entry computing positions `[start, start + n)` scores: each position's next token, where
    that is still a prompt token (the last prompt position's next token is the first output)."""
    end = min(start + n, len(prompt_ids) - 1)
    return list(prompt_ids[start + 1 : end + 1])
