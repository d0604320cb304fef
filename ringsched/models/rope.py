"""The rotary position embedding a layer applies, from the model's `RopeScaling` (`weights/rope_scaling.py`)."""

from __future__ import annotations

import torch
from torch import nn

from ringsched.weights.rope_scaling import RopeScaling


class Rotary(nn.Module):
    """Rotate-half RoPE as Hugging Face computes it, over the first `rotary_dim` dimensions of each head (all of
    them unless `partial`). One instance serves every layer of a stage: the cos/sin table `[P, rotary_dim]` is
    built once (a 4096-position table is 2 MiB in float32; one per layer was 60 MiB for SmolLM2), and the rows
    for a batch's positions are gathered once per forward, not once per layer."""

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling | None = None) -> None:
        super().__init__()
        self.head_dim, self.theta, self.scaling = head_dim, theta, scaling or RopeScaling()
        self.rotary_dim = int(head_dim * self.scaling.partial_rotary_factor)
        self._cos = self._sin = torch.empty(0)
        self._rows: tuple[torch.Tensor, torch.dtype, torch.Tensor, torch.Tensor] | None = None
        self._covered: torch.Tensor | None = None  # the last `positions` `tables` grew the tables for

    @property
    def partial(self) -> bool:
        """Whether part of each head passes through unrotated (then `tables` does not describe the rotation)."""
        return self.rotary_dim < self.head_dim

    def _table(self, n: int, device: torch.device) -> None:
        size = max(n, 2 * self._cos.shape[0], 4096)
        positions = torch.arange(size, dtype=torch.float32)
        inv_freq, factor = self.scaling.inv_freq(self.rotary_dim, self.theta)
        freqs = torch.outer(positions, inv_freq)
        switch = self.scaling.long_from
        if switch is not None and size > switch:  # longrope: the long factors from the original length on
            long_freq, _ = self.scaling.inv_freq(self.rotary_dim, self.theta, long=True)
            freqs[switch:] = torch.outer(positions[switch:], long_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self._cos, self._sin = (emb.cos() * factor).to(device), (emb.sin() * factor).to(device)

    def _cover(self, positions: torch.Tensor, bound: int | None) -> None:
        """The tables grown to cover `positions` (`bound`: their largest, known on the host; else read from the
        device, a wait on a GPU)."""
        if bound is None:
            bound = int(positions.max()) if positions.numel() else -1
        if bound >= self._cos.shape[0] or self._cos.device != positions.device:
            self._table(bound + 1, positions.device)

    def _cos_sin(self, positions: torch.Tensor, dtype: torch.dtype, bound: int | None):
        # Every layer of one forward passes the same `positions` tensor: gather its rows for the first only.
        if self._rows is not None and self._rows[0] is positions and self._rows[1] == dtype:
            return self._rows[2], self._rows[3]
        self._cover(positions, bound)
        cos = self._cos[positions].unsqueeze(1).to(dtype)  # [T, 1, D]
        sin = self._sin[positions].unsqueeze(1).to(dtype)
        self._rows = (positions, dtype, cos, sin)
        return cos, sin

    def forget(self) -> None:
        """Drop the rows gathered for the last `positions`: a static step refills the same tensor in place."""
        self._rows = None

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, bound: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`q`, `k` rotated for `positions` (`bound`: the largest of them, if the host knows it)."""
        cos, sin = self._cos_sin(positions, q.dtype, bound)
        if self.partial:
            return _rotate_part(q, cos, sin), _rotate_part(k, cos, sin)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def tables(self, positions: torch.Tensor, bound: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole float32 cos and sin tables `[P, rotary_dim]`, grown to cover `positions` (checked once per
        forward; `bound` as in `forward`). The small step rotates whole heads with them: not for a `partial`
        rotary."""
        if self._covered is not positions:
            self._cover(positions, bound)
            self._covered = positions
        return self._cos, self._sin


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`x * cos + rotate_half(x) * sin`, the same operations in the same order (so the same bits) with two
    temporaries fewer: the products land in buffers this function owns."""
    x1, x2 = x.chunk(2, dim=-1)
    rot = torch.cat((x2, x1), dim=-1)
    rot[..., : x1.shape[-1]].neg_()
    return (x * cos).add_(rot.mul_(sin))


def _rotate_part(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`_rotate` over the first `cos.shape[-1]` dimensions of each head of `x` `[T, heads, D]`, the rest as they
    are (transformers' `apply_rotary_pos_emb` for a partial rotary)."""
    d = cos.shape[-1]
    return torch.cat((_rotate(x[..., :d], cos, sin), x[..., d:]), dim=-1)
