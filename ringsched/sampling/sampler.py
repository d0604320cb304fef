"""Next-token sampling on the last pipeline stage, and the log-probabilities that travel back with the tokens.

Contract: `sample(logits [S, V], params, histories, keys)` returns `[S]` int64 token ids, one per row.
First every row's logits get its `logit_bias`, then the penalties: repetition (HF/vLLM, over prompt and output),
then OpenAI's frequency and presence penalties (over the output only: `logit -= count * frequency +
(count > 0) * presence`). Greedy rows (`temperature == 0` or `top_k == 1`) take the argmax of that.
Random rows apply temperature, top-k, top-p, min-p and draw by inverse CDF with the uniform `uniform(seed, index)`
of their key: a pure function of the request's seed and the index of the token in its output, so a row's token
depends only on its own logits, params and key, never on its batch companions, the process or the device, and a
request recomputed after preemption or replayed elsewhere draws the same token again.
Stop tokens, stop strings, `ignore_eos` and `min_tokens` are the caller's: it knows the eos id and how many
tokens a request has produced, and passes `banned` ids while a request is still under `min_tokens`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ringsched.sampling.params import SamplingParams


def logprob_values(logits: torch.Tensor, tokens: torch.Tensor, ks: Sequence[int | None]) -> torch.Tensor:
    """The log-probabilities rows ask for, as one int64 tensor (floats as their float64 bits, so they travel
    with the sampled ids): per row with `ks[i]` not None, its token's log-probability, then its `k` most likely
    ids, then their log-probabilities. `unpack_logprobs` reads them back."""
    rows = [i for i, k in enumerate(ks) if k is not None]
    if not rows:
        return torch.empty(0, dtype=torch.int64)
    lp = torch.log_softmax(logits[rows].float(), dim=-1).cpu()
    chosen = lp.gather(1, tokens[rows].cpu().clamp(min=0)[:, None])[:, 0]  # a failed row's -1 reads id 0
    kmax = max(ks[i] for i in rows)
    top = lp.topk(kmax, dim=-1) if kmax else None
    parts = []
    for j, i in enumerate(rows):
        parts.append(chosen[j : j + 1].double().view(torch.int64))
        if ks[i]:
            parts += [top.indices[j, : ks[i]], top.values[j, : ks[i]].double().view(torch.int64)]
    return torch.cat(parts)


Logprobs = tuple[float, list[tuple[int, float]]]  # a token's log-probability, and the top (id, log-probability)s


def unpack_logprobs(values: Sequence[int], ks: Sequence[int | None]) -> list[Logprobs | None]:
    """`logprob_values`'s ints back to, per row, None or its `Logprobs`."""
    floats = torch.tensor(list(values), dtype=torch.int64).view(torch.float64).tolist()
    out, at = [], 0
    for k in ks:
        if k is None:
            out.append(None)
            continue
        top = list(zip(values[at + 1 : at + 1 + k], floats[at + 1 + k : at + 1 + 2 * k], strict=True))
        out.append((floats[at], top))
        at += 1 + 2 * k
    return out


def logprob_width(ks: Sequence[int | None]) -> int:
    return sum(1 + 2 * k for k in ks if k is not None)


DrawKey = tuple[int, int]  # (the request's seed, the index of the token being drawn in the request's output)

_MASK64 = (1 << 64) - 1
_GOLDEN64 = 0x9E3779B97F4A7C15  # splitmix64's increment: 2**64 / the golden ratio, odd


def _mix64(z: int) -> int:
    """splitmix64's finaliser (Steele, Lea, Flood 2014): a bijection on 64-bit ints that mixes every bit."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def uniform(seed: int, index: int) -> float:
    """The float64 uniform in [0, 1) (53 random bits) a request with `seed` draws its `index`-th output token
    with. Counter-based, so no state to carry between steps or processes: the seed picks a splitmix64 stream
    (hashed first, so the streams of seeds `s` and `s + 1`, as `n` sequences get, are unrelated, not shifted
    copies) and `index` is the position in it. Plain 64-bit integer arithmetic: the same on every machine."""
    if index < 0:
        raise ValueError(f"a draw index counts the tokens a request has produced, so it is >= 0; got {index}")
    stream = _mix64((seed + _GOLDEN64) & _MASK64)  # a negative seed wraps as torch's manual_seed does
    return (_mix64((stream + (index + 1) * _GOLDEN64) & _MASK64) >> 11) * 2.0**-53


def apply_repetition_penalty(
    logits: torch.Tensor, penalties: Sequence[float], histories: Sequence[Sequence[int]]
) -> torch.Tensor:
    """HF/vLLM penalty, in place on float `logits` [S, V]: a seen token's logit > 0 is divided by the
    penalty, any other multiplied, so a penalty > 1 always makes it less likely. Returns `logits`."""
    rows = [i for i, p in enumerate(penalties) if p != 1.0 and len(histories[i]) > 0]
    if not rows:
        return logits
    width = max(len(histories[i]) for i in rows)
    # Pad each history with its own first token: a repeated id gets the same new value, written twice.
    padded = [list(histories[i]) + [histories[i][0]] * (width - len(histories[i])) for i in rows]
    cols = torch.tensor(padded, dtype=torch.int64, device=logits.device)  # [R, width]
    row_ids = torch.tensor(rows, device=logits.device)[:, None]  # [R, 1]
    pen = torch.tensor([penalties[i] for i in rows], dtype=logits.dtype, device=logits.device)[:, None]
    # Touch only the seen entries (R x width, not R x V); all are read before any is written.
    seen = logits[row_ids, cols]
    logits[row_ids, cols] = torch.where(seen > 0, seen / pen, seen * pen)
    return logits


def apply_logit_bias(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Each row's `logit_bias` added in place to float `logits` [S, V], in one indexed add for the batch."""
    rows, cols, vals = [], [], []
    for i, p in enumerate(params):
        for tok, bias in p.logit_bias:
            rows.append(i)
            cols.append(tok)
            vals.append(bias)
    if rows:
        dev = logits.device
        index = (torch.tensor(rows, device=dev), torch.tensor(cols, device=dev))
        logits.index_put_(index, torch.tensor(vals, dtype=logits.dtype, device=dev), accumulate=True)
    return logits


def apply_openai_penalties(
    logits: torch.Tensor, params: Sequence[SamplingParams], outputs: Sequence[Sequence[int]]
) -> torch.Tensor:
    """OpenAI's frequency and presence penalties in place on float `logits` [S, V]: a token the row's output
    holds `c` times loses `c * frequency_penalty + presence_penalty`. The counts of every penalised row are one
    scatter-add over the batch."""
    rows = [i for i, p in enumerate(params) if (p.frequency_penalty or p.presence_penalty) and len(outputs[i])]
    if not rows:
        return logits
    dev = logits.device
    counts = torch.zeros(len(rows), logits.shape[1], dtype=logits.dtype, device=dev)
    row_of = torch.tensor([j for j, i in enumerate(rows) for _ in outputs[i]], device=dev)
    col_of = torch.tensor([t for i in rows for t in outputs[i]], dtype=torch.int64, device=dev)
    counts.index_put_((row_of, col_of), torch.ones(len(col_of), dtype=logits.dtype, device=dev), accumulate=True)
    freq = torch.tensor([params[i].frequency_penalty for i in rows], dtype=logits.dtype, device=dev)[:, None]
    pres = torch.tensor([params[i].presence_penalty for i in rows], dtype=logits.dtype, device=dev)[:, None]
    logits[rows] -= counts * freq + (counts > 0).to(logits.dtype) * pres
    return logits


def _cutoff(logits: torch.Tensor, k: int, top_p: torch.Tensor) -> torch.Tensor:
    """Smallest logit each row keeps under top-k `k` then top-p `top_p` [G, 1]; returns [G, 1].

    Only sorted values are used, never indices, so the order a sort gives ties cannot change the answer;
    ties with the cutoff are all kept (as HF and vLLM do for top-k)."""
    vocab = logits.shape[-1]
    vals = logits.topk(k, dim=-1).values if k < vocab else logits.sort(dim=-1, descending=True).values
    probs = vals.softmax(dim=-1)  # [G, k]: top-p is measured within the top-k, as in HF
    # Keep a token while the mass ranked above it is < top_p: the smallest prefix whose mass reaches top_p,
    # never empty. Rows with top_p == 1 keep everything, so rounding in cumsum cannot clip their tail.
    above = torch.nn.functional.pad(probs.cumsum(dim=-1)[:, :-1], (1, 0))  # exclusive cumsum, monotone
    keep = (above < top_p) | (top_p >= 1)
    return vals.gather(1, keep.sum(dim=-1, keepdim=True) - 1)


def _filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p on [R, V] logits with per-row knobs; returns renormalised probs.

    Every op works row by row on a width fixed by the row's own params (rows are grouped by top_k), so a
    row's result does not depend on which rows share its batch."""
    dev, vocab = logits.device, logits.shape[-1]
    # Below 1e-5 (vLLM's epsilon) logits / T can overflow to inf and softmax to nan, hence the clamp.
    temps = torch.tensor([max(p.temperature, 1e-5) for p in params], device=dev)[:, None]
    logits = logits / temps
    top_k = [min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params]
    top_p = torch.tensor([p.top_p for p in params], device=dev)[:, None]
    cutoff = torch.full_like(top_p, -math.inf)  # [R, 1]
    filtered = False
    for k in set(top_k):
        rows = [i for i, rk in enumerate(top_k) if rk == k]
        if k < vocab or any(params[i].top_p < 1 for i in rows):
            cutoff[rows] = _cutoff(logits[rows], k, top_p[rows])
            filtered = True
    if filtered:
        logits = logits.masked_fill(logits < cutoff, -math.inf)
    probs = logits.softmax(dim=-1)
    if any(p.min_p > 0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], device=dev)[:, None]
        # min_p <= 1, so the most likely token always survives.
        probs = probs * (probs >= min_p * probs.amax(dim=-1, keepdim=True))
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def _draw(probs: torch.Tensor, keys: Sequence[DrawKey]) -> torch.Tensor:
    """Inverse CDF with one float64 uniform per row, `uniform(*key)` of that row's key: one number, not V,
    per row, and nothing that depends on the batch."""
    u = torch.tensor([uniform(seed, index) for seed, index in keys], dtype=torch.float64)
    cdf = probs.double().cumsum(dim=-1)  # [R, V]; float64 so rare tokens keep their share
    target = (u.to(probs.device) * cdf[:, -1])[:, None]  # scaled by the row total, which rounding moves off 1
    # right=True skips zero-probability tokens (their cdf step is flat); the clamp only guards against
    # u * total rounding up to total, a 1e-16 event.
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[-1] - 1)


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    histories: list[list[int]],
    keys: Sequence[DrawKey | None],
    banned: list[Sequence[int]] | None = None,
    prompt_lens: Sequence[int] | None = None,
    allowed: Sequence[torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """Next token per row of `logits` [S, V] (float32 or bf16); returns [S] int64.

    `histories[i]` is row i's prompt + generated ids (for the penalties: `prompt_lens[i]` of them are its
    prompt, 0 when not given); `keys[i]` is row i's (seed, index of the token it draws in its output), the
    `DrawKey` its uniform comes from, and may be None only when row i is greedy. `banned[i]`, if given,
    lists ids row i must not draw this step (stop ids and eos while under `min_tokens`); `allowed[i]`, if given
    and not None, is row i's `[V]` bool mask of the only tokens it may draw (a grammar's)."""
    n = logits.shape[0]
    if not len(params) == len(histories) == len(keys) == n or (banned is not None and len(banned) != n):
        raise ValueError(
            f"sample() needs one params/history/key(/banned) per logits row: {n} rows, got "
            f"{len(params)} params, {len(histories)} histories, {len(keys)} keys"
        )
    if banned is None and all(p.plain for p in params):
        return logits.argmax(dim=-1)  # the hot path: one kernel, no copy
    logits = logits.to(torch.float32, copy=True)  # we edit it in place; the caller's tensor stays intact
    apply_logit_bias(logits, params)
    for i, ids in enumerate(banned or []):
        if ids:
            logits[i, list(ids)] = -math.inf
    apply_repetition_penalty(logits, [p.repetition_penalty for p in params], histories)
    starts = prompt_lens if prompt_lens is not None else [0] * n
    apply_openai_penalties(logits, params, [h[s:] for h, s in zip(histories, starts, strict=True)])
    for i, mask in enumerate(allowed or []):
        if mask is not None:
            logits[i].masked_fill_(~mask.to(logits.device), -math.inf)
    tokens = logits.argmax(dim=-1)  # final for greedy rows; random rows are overwritten below
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        missing = [i for i in rows if keys[i] is None]
        if missing:
            raise ValueError(
                f"rows {missing} sample randomly (temperature > 0, top_k != 1) but have no key; give each "
                "such row (its request's seed, the index of the token it draws in the request's output)"
            )
        probs = _filtered_probs(logits[rows], [params[i] for i in rows])
        tokens[rows] = _draw(probs, [keys[i] for i in rows])
    return tokens
