"""Verification of model-free drafts on the last stage: which of a request's `k` draft tokens the model keeps.

A decode entry with drafts `d_1..d_k` computes `k + 1` positions; position `j` predicts output token `n + j` (`n`:
the tokens the request had produced) from the history extended by `d_1..d_j`. Each position's target token is
drawn by the ordinary sampler (`sampler.sample`) as if the drafts before it had been produced: the same
penalties over the same history, the same uniform `uniform(seed, n + j)`. The request keeps the targets up to
and including the first that differs from its draft (all `k + 1` when every draft agrees).

For a greedy row this is the longest agreeing prefix plus one token. For a random row it is rejection sampling
with a draft distribution that puts all its mass on `d_j` (a model-free drafter's): the draft is kept with
probability `p(d_j)`, as `min(1, p / q)` gives, and a rejected position's token is distributed as `p` without
`d_j`, renormalised, which is the residual `max(p - q, 0)`. Drawing the target by the request's own uniform and
comparing makes both hold at once, and more: the tokens are exactly those decoding without drafts draws with the
same seed, so speculation changes how fast a request goes, never what it says.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ringsched.sampling.params import SamplingParams
from ringsched.sampling.sampler import DrawKey, sample

Rows = tuple[list[SamplingParams], list[list[int]], list[DrawKey | None]]

# On the way back to stage 0 a verified entry's kept tokens are padded with this to its `1 + k` sampled values, so
# the last stage's message has a length stage 0 knows from its plan.
FILLER = -2


def padded(kept: Sequence[int], rows: int) -> list[int]:
    return [*kept, *[FILLER] * (rows - len(kept))]


def unpadded(values: Sequence[int]) -> list[int]:
    return [v for v in values if v != FILLER]


def expand(
    drafts: Sequence[Sequence[int]],
    params: Sequence[SamplingParams],
    histories: Sequence[list[int]],
    keys: Sequence[DrawKey | None],
) -> Rows:
    """Per request `r`, `len(drafts[r]) + 1` sampler rows (its positions, in order): its params, its history
    extended by the drafts before the position (the same list where no penalty reads it: no copy per position),
    its key advanced by the position."""
    rows_params, rows_hist, rows_keys = [], [], []
    for d, p, h, key in zip(drafts, params, histories, keys, strict=True):
        penalised = p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty
        for j in range(len(d) + 1):
            rows_params.append(p)
            rows_hist.append([*h, *d[:j]] if penalised and j else h)  # only penalties read a history
            rows_keys.append(None if key is None else (key[0], key[1] + j))
    return rows_params, rows_hist, rows_keys


def accept(targets: Sequence[int], draft: Sequence[int]) -> list[int]:
    """The tokens a request keeps: its targets up to and including the first that is not its draft."""
    for j, d in enumerate(draft):
        if targets[j] != d:
            return list(targets[: j + 1])
    return list(targets[: len(draft) + 1])


def verify(
    logits: torch.Tensor,
    drafts: Sequence[Sequence[int]],
    params: Sequence[SamplingParams],
    histories: Sequence[list[int]],
    keys: Sequence[DrawKey | None],
    prompt_lens: Sequence[int] | None = None,
) -> list[list[int]]:
    """The tokens each request keeps. `logits` [sum(len(d) + 1), V]: each request's positions in order, requests
    in the order of `drafts`; the rest as `sampler.sample` takes them, one per request. Stop tokens and strings
    among the kept tokens are the caller's to cut at, as for one token."""
    rows_params, rows_hist, rows_keys = expand(drafts, params, histories, keys)
    lens = None
    if prompt_lens is not None:
        lens = [n for d, n in zip(drafts, prompt_lens, strict=True) for _ in range(len(d) + 1)]
    targets = sample(logits, rows_params, rows_hist, rows_keys, prompt_lens=lens).tolist()
    out, at = [], 0
    for d in drafts:
        out.append(accept(targets[at : at + len(d) + 1], d))
        at += len(d) + 1
    return out
