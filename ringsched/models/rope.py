"""RoPE frequencies, plain or scaled, from a checkpoint's `rope_scaling` (most configs) or `rope_parameters`
(what transformers 5 writes): the same inverse frequencies and cos/sin factor transformers computes.

Types: `default`; `linear` (positions divided by `factor`); `llama3` (Llama 3.1+: long wavelengths divided by
`factor`, short ones kept, a smooth ramp between); `yarn` (a ramp between interpolated and extrapolated
frequencies over the dimensions, and cos/sin scaled by an attention factor); `dynamic` (NTK-aware: transformers
raises the base only once a sequence passes `max_position_embeddings`, and the context length here never does
(`--max-model-len` is capped there), so within it the frequencies are the plain ones, as in transformers).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


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

    @classmethod
    def from_config(cls, cfg: dict) -> tuple[float, RopeScaling]:
        """`(rope_theta, scaling)` from a config dict; `RopeConfigError` naming the field for what is not run."""
        params = dict(cfg.get("rope_scaling") or cfg.get("rope_parameters") or {})
        field = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
        theta = float(cfg.get("rope_theta", params.get("rope_theta", 10000.0)))
        kind = params.get("rope_type", params.get("type", "default"))
        if kind not in ROPE_TYPES:
            raise RopeConfigError(f"{field} of type {kind!r} is not supported; ringsched runs {', '.join(ROPE_TYPES)}")
        if kind == "default":
            return theta, cls()
        if "factor" not in params and kind != "yarn":
            raise RopeConfigError(f"{field} of type {kind!r} needs a factor")
        original = params.get("original_max_position_embeddings", cfg.get("original_max_position_embeddings"))
        if original is None and kind in ("llama3", "yarn"):
            original = cfg.get("max_position_embeddings")
        factor = params.get("factor")
        if factor is None:  # yarn without a factor: the extension of the context
            factor = cfg["max_position_embeddings"] / original
        known = {"rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings"}
        extra = {k: v for k, v in params.items() if k in cls.__dataclass_fields__ and k not in known and v is not None}
        if cfg.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0)) != 1.0:
            raise RopeConfigError("partial_rotary_factor other than 1.0 is not supported")
        return theta, cls(rope_type=kind, factor=float(factor), original_max_position_embeddings=original, **extra)

    def inv_freq(self, head_dim: int, theta: float) -> tuple[torch.Tensor, float]:
        """The inverse frequencies `[head_dim / 2]` and the factor cos and sin are multiplied by."""
        base = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
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
