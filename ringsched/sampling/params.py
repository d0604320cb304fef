"""`SamplingParams`: how one request samples (vLLM's field names), every value checked where it is made, with
an error that names the field. The sampler that applies them is `sampler.py`."""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass, fields, replace
from typing import Any


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
    # Prompt log-probabilities (vLLM's `prompt_logprobs`): None for none, k >= 0 for, at every prompt token after
    # the first, its log-probability and rank given the tokens before it, and the k most likely tokens there
    prompt_logprobs: int | None = None
    # Structured output: an llguidance grammar (`structured.grammar_for`) the tokens must follow; the last
    # stage masks every other token
    grammar: str | None = None
    # The grammar applies only after the output holds these tokens (a reasoning model's end-of-thinking tag: the
    # server sets it with --reasoning-parser), every token admitted before them
    grammar_after: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        # JSON and msgpack hand us lists (and the OpenAI API a bare string or null for `stop`).
        stop = () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else self.stop
        ids = () if self.stop_token_ids is None else self.stop_token_ids
        _require(isinstance(stop, (list, tuple)), "stop", "a string or a list of strings", stop)
        _require(isinstance(ids, (list, tuple)), "stop_token_ids", "a list of token ids", ids)
        object.__setattr__(self, "stop", tuple(stop))
        object.__setattr__(self, "stop_token_ids", tuple(ids))
        after = self.grammar_after
        _require(isinstance(after, (list, tuple)) and len(after) <= 16, "grammar_after", "up to 16 token ids", after)
        _require(all(_is_int64(i) and i >= 0 for i in after), "grammar_after", "token ids (ints >= 0)", after)
        object.__setattr__(self, "grammar_after", tuple(after))
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        # Numbers become floats here, so an int too large for a float is refused now, not on a stage.
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            object.__setattr__(self, name, _finite(name, getattr(self, name)))
        self._check_numbers()
        self._check_stops()
        _require(isinstance(self.ignore_eos, bool), "ignore_eos", "a bool", self.ignore_eos)
        _require(
            self.grammar is None or isinstance(self.grammar, str), "grammar", "None or a grammar string", self.grammar
        )

    def _check_numbers(self) -> None:
        n = self.max_tokens
        _require(_is_int64(n) and n >= 1, "max_tokens", "an int in [1, 2**63)", n)
        _require(self.temperature >= 0, "temperature", ">= 0", self.temperature)
        _require(0 < self.top_p <= 1, "top_p", "in (0, 1]", self.top_p)
        top_k_ok = _is_int64(self.top_k) and self.top_k >= -1
        _require(top_k_ok, "top_k", "-1 or 0 (disabled) or an int in [1, 2**63)", self.top_k)
        _require(0 <= self.min_p <= 1, "min_p", "in [0, 1]", self.min_p)
        seed_ok = self.seed is None or (_is_int(self.seed) and -(2**63) <= self.seed < 2**64)
        _require(seed_ok, "seed", "None or an int in [-2**63, 2**64) (64 bits, signed or not)", self.seed)
        _require(self.repetition_penalty > 0, "repetition_penalty", "> 0 (1.0 disables it)", self.repetition_penalty)
        min_ok = _is_int64(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens
        _require(min_ok, "min_tokens", f"an int in [0, max_tokens={self.max_tokens}]", self.min_tokens)
        for name in ("presence_penalty", "frequency_penalty"):
            _require(-2 <= getattr(self, name) <= 2, name, "in [-2, 2]", getattr(self, name))
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            ok = k is None or (_is_int(k) and 0 <= k <= MAX_LOGPROBS)
            _require(ok, name, f"None or an int in [0, {MAX_LOGPROBS}]", k)

    def _check_stops(self) -> None:
        ids = self.stop_token_ids
        _require(len(ids) <= MAX_STOP_TOKEN_IDS, "stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids", len(ids))
        ids_ok = all(_is_int64(i) and i >= 0 for i in ids)
        _require(ids_ok, "stop_token_ids", "a list of ints in [0, 2**63)", _shorten(ids))
        stop = self.stop
        _require(len(stop) <= MAX_STOP_STRINGS, "stop", f"at most {MAX_STOP_STRINGS} strings", len(stop))
        stop_ok = all(isinstance(s, str) and s for s in stop)
        _require(stop_ok, "stop", "a string or a list of non-empty strings", _shorten(stop))
        longest = max((len(s) for s in stop), default=0)
        _require(
            longest <= MAX_STOP_STRING_CHARS,
            "stop",
            f"strings of at most {MAX_STOP_STRING_CHARS} characters (the length of the longest one is shown)",
            longest,
        )

    @property
    def plain(self) -> bool:
        """Greedy with nothing that edits the logits: the argmax of the raw logits is the token."""
        return (
            self.greedy
            and self.repetition_penalty == 1.0
            and not self.logit_bias
            and self.min_tokens == 0
            and self.presence_penalty == 0
            and self.frequency_penalty == 0
            and self.logprobs is None
            and self.grammar is None
        )

    @property
    def needs_history(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    def seeded(self, rng: random.Random) -> SamplingParams:
        """These params, with a seed from `rng` if they sample randomly without one. The front ends call it once per
        request in arrival order (`--seed` seeds `rng`, so a run repeats), before the request first goes to the
        ring: a replay then carries the seed it first ran with and draws the same tokens."""
        if self.seed is not None or self.greedy:
            return self
        return replace(self, seed=rng.randrange(2**31))

    def to_dict(self) -> dict[str, Any]:
        """Plain types only (lists, not tuples), for msgpack and JSON."""
        d = asdict(self)
        d["stop_token_ids"] = list(self.stop_token_ids)
        d["stop"] = list(self.stop)
        d["logit_bias"] = [list(pair) for pair in self.logit_bias]
        d["grammar_after"] = list(self.grammar_after)
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
        _require(isinstance(pair, (list, tuple)) and len(pair) == 2, "logit_bias", "a map of token ids to biases", pair)
        key, bias = pair
        if isinstance(key, str) and key.strip().isdigit():
            key = int(key)
        _require(_is_int64(key) and key >= 0, "logit_bias", "keyed by token ids (ints >= 0)", key)
        bias = _finite("logit_bias", bias)
        _require(-100 <= bias <= 100, "logit_bias", "biases in [-100, 100]", bias)
        out[key] = bias
    return tuple(sorted(out.items()))
