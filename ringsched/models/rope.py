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
from torch import nn

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


class Rotary(nn.Module):
    """Rotate-half RoPE as Hugging Face computes it. One instance serves every layer of a stage: the cos/sin
    table is built once (a 4096-position table is 2 MiB in float32; one per layer was 60 MiB for SmolLM2), and
    the rows for a batch's positions are gathered once per forward, not once per layer."""

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling | None = None) -> None:
        super().__init__()
        self.head_dim, self.theta, self.scaling = head_dim, theta, scaling or RopeScaling()
        self._cos = self._sin = torch.empty(0)
        self._rows: tuple[torch.Tensor, torch.dtype, torch.Tensor, torch.Tensor] | None = None
        self._covered: torch.Tensor | None = None  # the last `positions` `tables` grew the tables for

    def _table(self, n: int, device: torch.device) -> None:
        size = max(n, 2 * self._cos.shape[0], 4096)
        inv_freq, factor = self.scaling.inv_freq(self.head_dim, self.theta)
        freqs = torch.outer(torch.arange(size, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self._cos, self._sin = (emb.cos() * factor).to(device), (emb.sin() * factor).to(device)

    def _cos_sin(self, positions: torch.Tensor, dtype: torch.dtype, device: torch.device):
        # Every layer of one forward passes the same `positions` tensor: gather its rows for the first only.
        if self._rows is not None and self._rows[0] is positions and self._rows[1] == dtype:
            return self._rows[2], self._rows[3]
        need = int(positions.max()) + 1 if positions.numel() else 0
        if need > self._cos.shape[0] or self._cos.device != device:
            self._table(need, device)
        cos = self._cos[positions].unsqueeze(1).to(dtype)  # [T, 1, D]
        sin = self._sin[positions].unsqueeze(1).to(dtype)
        self._rows = (positions, dtype, cos, sin)
        return cos, sin

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self._cos_sin(positions, q.dtype, q.device)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole float32 cos and sin tables `[P, D]`, grown to cover `positions` (checked once per forward)."""
        if self._covered is not positions:
            need = int(positions.max()) + 1 if positions.numel() else 0
            if need > self._cos.shape[0] or self._cos.device != positions.device:
                self._table(need, positions.device)
            self._covered = positions
        return self._cos, self._sin


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`x * cos + rotate_half(x) * sin`, the same operations in the same order (so the same bits) with two
    temporaries fewer: the products land in buffers this function owns."""
    x1, x2 = x.chunk(2, dim=-1)
    rot = torch.cat((x2, x1), dim=-1)
    rot[..., : x1.shape[-1]].neg_()
    return (x * cos).add_(rot.mul_(sin))
