"""RoPE frequencies, plain or scaled, from a checkpoint's `rope_scaling` (most configs) or `rope_parameters`
(what transformers 5 writes): the same inverse frequencies and cos/sin factor transformers computes.

Types: `default`; `linear` (positions divided by `factor`); `llama3` (Llama 3.1+: long wavelengths divided by
`factor`, short ones kept, a smooth ramp between); `yarn` (a ramp between interpolated and extrapolated
frequencies over the dimensions, and cos/sin scaled by an attention factor); `dynamic` (NTK-aware: transformers
raises the base only once a sequence passes `max_position_embeddings`, and the context length here never does
(`--max-model-len` is capped there), so within it the frequencies are the plain ones, as in transformers);
`longrope` (Phi-3, alias `su`: each frequency divided by its entry of `short_factor` or `long_factor`, cos/sin
scaled by `sqrt(1 + log(factor) / log(original_max_position_embeddings))`).

longrope's choice of factors. transformers picks them per forward call: `long_factor` for every position of a
call whose last position is at or past `original_max_position_embeddings` (`longrope_frequency_update`), else
`short_factor`. Here the table is chosen per position: `short_factor` below that length, `long_factor` from it.
That is transformers' choice exactly for a prompt within the original length, however long the output (each
decode call is one position; the cached keys keep the rotation their own call gave them). A longer prompt
transformers rotates wholly with `long_factor` (so its first positions differ here); vLLM's choice differs too
(per batch).

`partial_rotary_factor` (Phi-4-mini: 0.75): only the first `int(head_dim * factor)` dimensions of each head are
rotated (rotate-half over those), the rest pass through, as transformers' Phi-3 does. It is read from the
config's top level, where Phi-3 configs hold it (transformers 5 keeps it there and copies it into
`rope_parameters`); `checkpoint_check` refuses it there for families that do not honour it. One only in
`rope_parameters`, where transformers 5 writes other families', is refused here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")
# rope_scaling's fields `from_config` reads itself (the others of `RopeScaling`'s fields are taken as they are)
_READ = frozenset(
    {
        "rope_type",
        "type",
        "rope_theta",
        "factor",
        "original_max_position_embeddings",
        "partial_rotary_factor",
        "short_factor",
        "long_factor",
    }
)


class RopeConfigError(ValueError):
    pass


@dataclass(frozen=True)
class RopeScaling:
    rope_type: str = "default"
    factor: float = 1.0
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    # yarn
    attention_factor: float | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    # longrope: each frequency's divisor below `original_max_position_embeddings` and from it
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    partial_rotary_factor: float = 1.0  # the share of each head's dimensions rotated (see the module's docstring)

    @classmethod
    def from_config(cls, cfg: dict) -> tuple[float, RopeScaling]:
        """`(rope_theta, scaling)` from a config dict; `RopeConfigError` naming the field for what is not run."""
        params = dict(cfg.get("rope_scaling") or cfg.get("rope_parameters") or {})
        field = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
        theta = float(cfg.get("rope_theta", params.get("rope_theta", 10000.0)))
        written = params.get("rope_type", params.get("type", "default"))
        # Phi-3's older names for longrope ("yarn" with longrope's factors: transformers' Phi3Config reads it so)
        longrope = written == "su" or (written == "yarn" and "short_factor" in params)
        kind = "longrope" if longrope else written
        if kind not in ROPE_TYPES:
            raise RopeConfigError(f"{field} of type {kind!r} is not supported; ringsched runs {', '.join(ROPE_TYPES)}")
        partial = _partial_factor(cfg, params)
        if kind == "default":
            return theta, cls(partial_rotary_factor=partial)
        if "factor" not in params and kind not in ("yarn", "longrope"):
            raise RopeConfigError(f"{field} of type {kind!r} needs a factor")
        original = params.get("original_max_position_embeddings", cfg.get("original_max_position_embeddings"))
        if original is None and kind in ("llama3", "yarn"):
            original = cfg.get("max_position_embeddings")
        if original is None and kind == "longrope":
            raise RopeConfigError(f"{field} of type {written!r} needs original_max_position_embeddings")
        factor = params.get("factor")
        if factor is None:  # yarn or longrope without a factor: the extension of the context
            factor = cfg["max_position_embeddings"] / original
        extra = {k: v for k, v in params.items() if k in cls.__dataclass_fields__ and k not in _READ and v is not None}
        if kind == "longrope":
            extra.update(_longrope_factors(cfg, params, partial, f"{field} of type {written!r}"))
        return theta, cls(
            rope_type=kind,
            factor=float(factor),
            original_max_position_embeddings=original,
            partial_rotary_factor=partial,
            **extra,
        )

    @property
    def long_from(self) -> int | None:
        """longrope: the first position rotated with `long_factor` (see the module's docstring); else None."""
        return self.original_max_position_embeddings if self.rope_type == "longrope" else None

    def inv_freq(self, head_dim: int, theta: float, long: bool = False) -> tuple[torch.Tensor, float]:
        """The inverse frequencies `[head_dim / 2]` and the factor cos and sin are multiplied by (`head_dim`: the
        dimensions rotated); `long`: longrope's for positions from `long_from`."""
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        if self.rope_type == "longrope":
            ext = torch.tensor(self.long_factor if long else self.short_factor, dtype=torch.float32)
            return 1.0 / (ext * theta**exponents), self._longrope_attention()
        base = 1.0 / (theta**exponents)
        if self.rope_type == "linear":
            return base / self.factor, 1.0
        if self.rope_type == "llama3":
            return self._llama3(base), 1.0
        if self.rope_type == "yarn":
            return self._yarn(head_dim, theta)
        return base, 1.0  # default, dynamic (see the module's docstring)

    def _llama3(self, inv_freq: torch.Tensor) -> torch.Tensor:
        old = self.original_max_position_embeddings
        low_wavelen, high_wavelen = old / self.low_freq_factor, old / self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / self.factor, inv_freq)
        smooth = (old / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)

    def _longrope_attention(self) -> float:
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.factor <= 1.0:
            return 1.0
        return math.sqrt(1 + math.log(self.factor) / math.log(self.original_max_position_embeddings))

    def _yarn(self, dim: int, theta: float) -> tuple[torch.Tensor, float]:
        def get_mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        factor, attention = self.factor, self.attention_factor
        if attention is None:
            if self.mscale and self.mscale_all_dim:
                attention = get_mscale(factor, self.mscale) / get_mscale(factor, self.mscale_all_dim)
            else:
                attention = get_mscale(factor)

        def correction_dim(rotations: float) -> float:
            old = self.original_max_position_embeddings
            return dim * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # no zero-width ramp
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
        extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
        keep = 1 - ramp  # the share of the extrapolated (unscaled) frequency per dimension
        return interpolation * (1 - keep) + extrapolation * keep, float(attention)


def _partial_factor(cfg: dict, params: dict) -> float:
    """The config's top-level `partial_rotary_factor` (1.0 where absent); one only in `rope_parameters` is refused
    (see the module's docstring)."""
    top, nested = cfg.get("partial_rotary_factor"), params.get("partial_rotary_factor")
    if top is None and nested not in (None, 1, 1.0):
        raise RopeConfigError(
            f"rope_parameters: partial_rotary_factor = {nested}: rotary embedding on part of each "
            "head is not supported for this architecture"
        )
    return float(top if top is not None else 1.0)


def _longrope_factors(cfg: dict, params: dict, partial: float, where: str) -> dict:
    """longrope's `short_factor` and `long_factor` as tuples, each one entry per rotated frequency; `where` names
    the config's field in errors."""
    out = {}
    for name in ("short_factor", "long_factor"):
        if not isinstance(params.get(name), list):
            raise RopeConfigError(f"{where} needs {name}, a list of numbers")
        out[name] = tuple(float(v) for v in params[name])
    if "hidden_size" in cfg and "num_attention_heads" in cfg:
        half = int((cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]) * partial) // 2
        for name, values in out.items():
            if len(values) != half:
                raise RopeConfigError(f"{where}: {name} has {len(values)} entries; the rotated half-head has {half}")
    return out
