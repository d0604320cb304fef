"""Next-token sampling on the last pipeline stage.

Contract: `sample(logits [S, V], params, histories, generators)` returns `[S]` int64 token ids, one per row.
First every row's logits get its `logit_bias`, then the penalties: repetition (HF/vLLM, over prompt and output),
then OpenAI's frequency and presence penalties (over the output only: `logit -= count * frequency +
(count > 0) * presence`). Greedy rows (`temperature == 0` or `top_k == 1`) take the argmax of that.
Random rows apply temperature, top-k, top-p, min-p and draw with their own generator,
so a row's token depends only on its own logits, params and generator state, never on its batch companions.
Stop tokens, stop strings, `ignore_eos` and `min_tokens` are the caller's: it knows the eos id and how many
tokens a request has produced, and passes `banned` ids while a request is still under `min_tokens`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch


def _require(ok: bool, name: str, rule: str, value: Any) -> None:
    if not ok:
        raise ValueError(f"{name} must be {rule}, got {_shown(value)}")


def _shown(value: Any, limit: int = 200) -> str:
    """An error message quotes the offending value, but never a megabyte of it."""
    if _is_int(value) and value.bit_length() > 256:  # repr of a huge int is slow, or refused past 4300 digits
        return f"an int of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


def _finite(name: str, value: Any) -> float:
    """`value` as a float; a ValueError naming `name` unless it is a finite number."""
    try:
        out = float(value) if _is_num(value) else math.nan
    except OverflowError:  # an int beyond float's range
        out = math.inf
    _require(math.isfinite(out), name, "a finite number", value)
    return out


def _shorten(items: tuple) -> tuple:
    return items if len(items) <= 8 else (*items[:8], "...")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)  # bool is an int subclass, but never a count


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _is_int64(x: Any) -> bool:
    """An int that msgpack, torch and numpy all carry as int64."""
    return _is_int(x) and INT64_MIN <= x <= INT64_MAX


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# Bounds on the lists a request may carry (each costs work per generated token: the front end scans every
# stop string after each token, the last stage bans stop ids while under min_tokens).
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS = 300  # OpenAI's limit on logit_bias entries
MAX_LOGPROBS = 20  # top log-probabilities a request may ask for per token (OpenAI's chat limit, vLLM's default)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 => greedy (as vLLM)
    top_p: float = 1.0  # (0, 1]
    top_k: int = -1  # -1 or 0 => disabled; else >= 1
    min_p: float = 0.0  # [0, 1]
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings: the front end applies them; kept so the params travel whole
    ignore_eos: bool = False
    repetition_penalty: float = 1.0  # > 0; as HF/vLLM, over prompt + generated tokens
    min_tokens: int = 0
    presence_penalty: float = 0.0  # [-2, 2], OpenAI's: subtracted once from every token the output holds
    frequency_penalty: float = 0.0  # [-2, 2], OpenAI's: subtracted per occurrence in the output
    # OpenAI's logit_bias: (token id, bias in [-100, 100]) pairs added to the logits; a dict is accepted (its
    # keys may be strings, as JSON gives them) and kept sorted by id
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Log-probabilities to return with each token: None for none, k >= 0 for the sampled token's and the k most
    # likely ones' (the model's own distribution: log_softmax of the raw logits, as vLLM's default)
    logprobs: int | None = None
    # Structured output: an llguidance grammar (`structured.grammar_for`) the tokens must follow; the last
    # stage masks every other token
    grammar: str | None = None

    def __post_init__(self) -> None:
        # JSON and msgpack hand us lists (and the OpenAI API a bare string or null for `stop`).
        stop = () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else self.stop
        ids = () if self.stop_token_ids is None else self.stop_token_ids
        _require(isinstance(stop, (list, tuple)), "stop", "a string or a list of strings", stop)
        _require(isinstance(ids, (list, tuple)), "stop_token_ids", "a list of token ids", ids)
        object.__setattr__(self, "stop", tuple(stop))
        object.__setattr__(self, "stop_token_ids", tuple(ids))
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        # Numbers become floats here, so an int too large for a float is refused now, not on a stage.
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            object.__setattr__(self, name, _finite(name, getattr(self, name)))

        n = self.max_tokens
        _require(_is_int64(n) and n >= 1, "max_tokens", "an int in [1, 2**63)", n)
        _require(self.temperature >= 0, "temperature", ">= 0", self.temperature)
        _require(0 < self.top_p <= 1, "top_p", "in (0, 1]", self.top_p)
        top_k_ok = _is_int64(self.top_k) and self.top_k >= -1
        _require(top_k_ok, "top_k", "-1 or 0 (disabled) or an int in [1, 2**63)", self.top_k)
        _require(0 <= self.min_p <= 1, "min_p", "in [0, 1]", self.min_p)
        seed_ok = self.seed is None or (_is_int(self.seed) and -(2**63) <= self.seed < 2**64)
        _require(seed_ok, "seed", "None or an int in [-2**63, 2**64) (torch's range)", self.seed)
        ids = self.stop_token_ids
        _require(len(ids) <= MAX_STOP_TOKEN_IDS, "stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids", len(ids))
        ids_ok = all(_is_int64(i) and i >= 0 for i in ids)
        _require(ids_ok, "stop_token_ids", "a list of ints in [0, 2**63)", _shorten(ids))
        stop = self.stop
        _require(len(stop) <= MAX_STOP_STRINGS, "stop", f"at most {MAX_STOP_STRINGS} strings", len(stop))
        stop_ok = all(isinstance(s, str) and s for s in stop)
        _require(stop_ok, "stop", "a string or a list of non-empty strings", _shorten(stop))
        longest = max((len(s) for s in stop), default=0)
        _require(longest <= MAX_STOP_STRING_CHARS, "stop", f"strings of at most {MAX_STOP_STRING_CHARS} characters "
                 "(the length of the longest one is shown)", longest)  # fmt: skip
        _require(isinstance(self.ignore_eos, bool), "ignore_eos", "a bool", self.ignore_eos)
        _require(self.repetition_penalty > 0, "repetition_penalty", "> 0 (1.0 disables it)", self.repetition_penalty)
        min_ok = _is_int64(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens
        _require(min_ok, "min_tokens", f"an int in [0, max_tokens={self.max_tokens}]", self.min_tokens)
        for name in ("presence_penalty", "frequency_penalty"):
            _require(-2 <= getattr(self, name) <= 2, name, "in [-2, 2]", getattr(self, name))
        _require(self.grammar is None or isinstance(self.grammar, str), "grammar", "None or a grammar string",
                 self.grammar)  # fmt: skip
        k = self.logprobs
        _require(k is None or (_is_int(k) and 0 <= k <= MAX_LOGPROBS), "logprobs", f"None or an int in [0, "
                 f"{MAX_LOGPROBS}]", k)  # fmt: skip

    @property
    def plain(self) -> bool:
        """Greedy with nothing that edits the logits: the argmax of the raw logits is the token."""
        return (self.greedy and self.repetition_penalty == 1.0 and not self.logit_bias and self.min_tokens == 0
                and self.presence_penalty == 0 and self.frequency_penalty == 0
                and self.logprobs is None and self.grammar is None)  # fmt: skip

    @property
    def needs_history(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    def to_dict(self) -> dict[str, Any]:
        """Plain types only (lists, not tuples), for msgpack and JSON."""
        d = asdict(self)
        d["stop_token_ids"] = list(self.stop_token_ids)
        d["stop"] = list(self.stop)
        d["logit_bias"] = [list(pair) for pair in self.logit_bias]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(d) - set(known))
        if unknown:
            raise ValueError(f"unknown SamplingParams field(s) {unknown}; known fields: {known}")
        return cls(**d)


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """`logit_bias` as sorted (id, bias) pairs, from a dict (keys ints or digit strings) or a list of pairs."""
    if value is None:
        return ()
    if isinstance(value, dict):
        value = list(value.items())
    _require(isinstance(value, (list, tuple)), "logit_bias", "a map of token ids to biases", value)
    _require(len(value) <= MAX_LOGIT_BIAS, "logit_bias", f"at most {MAX_LOGIT_BIAS} entries", len(value))
    out = {}
    for pair in value:
        _require(isinstance(pair, (list, tuple)) and len(pair) == 2, "logit_bias", "a map of token ids to biases",
                 pair)  # fmt: skip
        key, bias = pair
        if isinstance(key, str) and key.strip().isdigit():
            key = int(key)
        _require(_is_int64(key) and key >= 0, "logit_bias", "keyed by token ids (ints >= 0)", key)
        bias = _finite("logit_bias", bias)
        _require(-100 <= bias <= 100, "logit_bias", "biases in [-100, 100]", bias)
        out[key] = bias
    return tuple(sorted(out.items()))


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


def make_generator(seed: int, device: str | torch.device = "cpu") -> torch.Generator:
    """One generator per request, seeded once. A CPU one is fine for GPU logits (and cheapest: a row takes
    one number per step from it); a generator on the logits' device works too."""
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


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


def _draw(probs: torch.Tensor, generators: Sequence[torch.Generator]) -> torch.Tensor:
    """Inverse CDF with one float64 uniform per row from that row's own generator: every call advances a
    generator by exactly one draw whatever the batch holds, and costs one number, not V, per row."""
    u = torch.cat([torch.rand(1, generator=g, dtype=torch.float64, device=g.device) for g in generators])
    cdf = probs.double().cumsum(dim=-1)  # [R, V]; float64 so rare tokens keep their share
    target = (u.to(probs.device) * cdf[:, -1])[:, None]  # scaled by the row total, which rounding moves off 1
    # right=True skips zero-probability tokens (their cdf step is flat); the clamp only guards against
    # u * total rounding up to total, a 1e-16 event.
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[-1] - 1)


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    histories: list[list[int]],
    generators: list[torch.Generator | None],
    banned: list[Sequence[int]] | None = None,
    prompt_lens: Sequence[int] | None = None,
    allowed: Sequence[torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """Next token per row of `logits` [S, V] (float32 or bf16); returns [S] int64.

    `histories[i]` is row i's prompt + generated ids (for the penalties: `prompt_lens[i]` of them are its
    prompt, 0 when not given); `generators[i]` may be None only when row i is greedy. `banned[i]`, if given,
    lists ids row i must not draw this step (stop ids and eos while under `min_tokens`); `allowed[i]`, if given
    and not None, is row i's `[V]` bool mask of the only tokens it may draw (a grammar's)."""
    n = logits.shape[0]
    if not len(params) == len(histories) == len(generators) == n or (banned is not None and len(banned) != n):
        raise ValueError(
            f"sample() needs one params/history/generator(/banned) per logits row: {n} rows, got "
            f"{len(params)} params, {len(histories)} histories, {len(generators)} generators"
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
        missing = [i for i in rows if generators[i] is None]
        if missing:
            raise ValueError(
                f"rows {missing} sample randomly (temperature > 0, top_k != 1) but have no generator; "
                "give each such request one from make_generator(seed)"
            )
        probs = _filtered_probs(logits[rows], [params[i] for i in rows])
        tokens[rows] = _draw(probs, [generators[i] for i in rows])
    return tokens
