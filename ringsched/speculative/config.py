"""`SpeculativeConfig`: vLLM's `--speculative-config` JSON shape for the model-free methods, every value checked.

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    {"method": "suffix", "num_speculative_tokens": 8}

As vLLM: an n-gram config naming neither lookup bound takes 5 for both, one naming only one takes it for both;
the suffix method's fields and defaults are vLLM's `suffix_decoding_*`. One field is ringsched's own: `"adaptive":
false` drafts as many tokens as the drafter proposes (up to `num_speculative_tokens`) on every step, where the
default weighs each draft against the measured step cost (`speculative/adaptive.py`); for tests and measurements
that must not depend on the host's speed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

METHODS = ("ngram", "suffix")
MAX_TOKENS = 16  # drafts per step: a verification step of k + 1 rows stays a decode-sized step


class SpeculativeConfigError(ValueError):
    """A `--speculative-config` value that cannot run, with the field named."""


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    adaptive: bool = True

    @classmethod
    def parse(cls, value: str | dict) -> SpeculativeConfig:
        """From the flag's JSON text (or its dict); a `SpeculativeConfigError` naming the field otherwise."""
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                example = '\'{"method": "ngram", "num_speculative_tokens": 4}\''
                raise SpeculativeConfigError(f"--speculative-config is not JSON ({e}); e.g. {example}") from None
        if not isinstance(value, dict):
            raise SpeculativeConfigError("--speculative-config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise SpeculativeConfigError(f"--speculative-config: unknown field(s) {unknown}; known: {sorted(known)}")
        for name in ("method", "num_speculative_tokens"):
            if name not in value:
                raise SpeculativeConfigError(f"--speculative-config needs {name!r}")
        value = dict(value)
        if value["method"] == "ngram":
            lo, hi = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
            value["prompt_lookup_min"] = lo if lo is not None else (hi if hi is not None else 5)
            value["prompt_lookup_max"] = hi if hi is not None else value["prompt_lookup_min"]
        config = cls(**value)
        config.check()
        return config

    def check(self) -> None:
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise SpeculativeConfigError(f"--speculative-config: {message}")

        need(self.method in METHODS, f"method must be one of {list(METHODS)}, got {self.method!r}")
        need(
            _int(self.num_speculative_tokens) and 1 <= self.num_speculative_tokens <= MAX_TOKENS,
            f"num_speculative_tokens must be an integer in 1..{MAX_TOKENS}, got {self.num_speculative_tokens!r}",
        )
        need(
            _int(self.prompt_lookup_min)
            and _int(self.prompt_lookup_max)
            and 1 <= self.prompt_lookup_min <= self.prompt_lookup_max,
            "prompt_lookup_min and prompt_lookup_max must be integers with 1 <= min <= max, got "
            f"{self.prompt_lookup_min!r} and {self.prompt_lookup_max!r}",
        )
        need(
            _int(self.suffix_decoding_max_tree_depth) and self.suffix_decoding_max_tree_depth >= 1,
            f"suffix_decoding_max_tree_depth must be an integer >= 1, got {self.suffix_decoding_max_tree_depth!r}",
        )
        need(
            _int(self.suffix_decoding_max_cached_requests) and self.suffix_decoding_max_cached_requests >= 0,
            "suffix_decoding_max_cached_requests must be an integer >= 0, got "
            f"{self.suffix_decoding_max_cached_requests!r}",
        )
        need(
            _number(self.suffix_decoding_max_spec_factor) and self.suffix_decoding_max_spec_factor > 0,
            f"suffix_decoding_max_spec_factor must be > 0, got {self.suffix_decoding_max_spec_factor!r}",
        )
        prob = self.suffix_decoding_min_token_prob
        need(_number(prob) and 0 <= prob <= 1, f"suffix_decoding_min_token_prob must be in [0, 1], got {prob!r}")
        need(isinstance(self.adaptive, bool), f"adaptive must be true or false, got {self.adaptive!r}")


def _int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)
