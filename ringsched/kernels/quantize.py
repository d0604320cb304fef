"""Weight-only quantisation at load (`--quantization int8` or `int4`); activations, the KV cache and norms stay in
the model dtype. What each costs in accuracy is measured by `scripts/check_quantization.py`.

- int8: each output row of a projection stored as int8 with one float32 scale, symmetric (`w ~= q * scale`, `q` in
  [-127, 127], `scale = max|w_row| / 127`). The lm_head is quantised too (on a small model with a tied embedding
  it is a fifth of the weights), the embedding it is tied to is not (a row is read per token).
- int4: the projections group-wise symmetric, one float32 scale per `INT4_GROUP` consecutive inputs of a row
  (`w ~= q * scale`, `q` in [-8, 7], the scale `max|w_group| / d` with the least squared error over `INT4_DIVISORS`),
  stored `q + 8`, two a byte in GGUF Q4_0's block order (`small_linear.dequantize_int4`).
  The MLP's down projection (and each expert's) is int8 per row, and so are the lm_head and the embedding: those
  are where int4 costs most accuracy (on SmolLM2, +0.18 nats per token with down_proj int4, +0.03 with it int8;
  llama.cpp's Q4_K_M keeps ffn_down at more bits for the same reason), and the embedding would otherwise stay
  float32, a fifth of SmolLM2. Tied and on one stage, one int8 tensor serves as embedding and head.
"""

from __future__ import annotations

import torch
from torch import nn

from ringsched.kernels.small_linear import Linear

QUANTIZATIONS = ("none", "int8", "int4")
INT4_GROUP = 32  # inputs per scale; 128 also runs natively (a third less scale memory, a little less accurate)


def quantize_int8_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`w` [N, K] (any float dtype) -> (int8 [N, K] contiguous, float32 scales [N])."""
    wf = w.detach().float()
    scales = wf.abs().amax(dim=1) / 127.0
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero row: any scale is exact
    q = torch.round(wf / scales[:, None]).clamp_(-127, 127).to(torch.int8).contiguous()
    return q, scales


def quantize_linear(layer: Linear) -> None:
    """Replace `layer`'s weight by its int8 rows and scales, in place."""
    q, scales = quantize_int8_weight(layer.weight)
    layer.weight = nn.Parameter(q, requires_grad=False)
    layer.scales = scales


def quantize_int4_weight(w: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """`w` [N, K] (any float dtype; K a multiple of `group`, 32 or 128) -> (packed uint8 [N, K/2], float32
    scales [N, K/group])."""
    n, k = w.shape
    if group not in (32, 128) or k % group:
        raise ValueError(
            f"int4 quantisation needs the input size to be a multiple of the group ({group}, of 32 or "
            f"128), got a {n}x{k} weight: use --quantization int8 for this model"
        )
    wf = w.detach().float().reshape(n, k // group, group)
    scales = torch.cat([_best_scales(rows) for rows in wf.split(1024)])
    q = (torch.round(wf / scales[:, :, None]).clamp_(-8, 7) + 8).to(torch.uint8).view(n, k // 32, 32)
    packed = (q[:, :, :16] | (q[:, :, 16:] << 4)).reshape(n, k // 2).contiguous()
    return packed, scales.contiguous()


# A group's scale is the one of these that rounds it with the least squared error: `max|w| / d` (d = 7 keeps both
# extremes; larger d resolve the many small weights finer and clip the largest into -8 or 7).
INT4_DIVISORS = tuple(7.0 + 0.25 * i for i in range(9))


def _best_scales(wf: torch.Tensor) -> torch.Tensor:
    """`wf` [rows, groups, group] -> the scale of each group (`INT4_DIVISORS`) with the least squared error."""
    amax = wf.abs().amax(dim=2)
    amax = torch.where(amax > 0, amax, torch.ones_like(amax))  # an all-zero group: any scale is exact
    best, best_err = None, None
    for d in INT4_DIVISORS:
        s = amax / d
        err = (torch.round(wf / s[:, :, None]).clamp_(-8, 7).mul_(s[:, :, None]) - wf).square_().sum(dim=2)
        if best is None:
            best, best_err = s, err
        else:
            better = err < best_err
            best, best_err = torch.where(better, s, best), torch.where(better, err, best_err)
    return best


def quantize_linear_int4(layer: Linear, group: int = INT4_GROUP) -> None:
    """Replace `layer`'s weight by its packed int4 values and group scales, in place."""
    packed, scales = quantize_int4_weight(layer.weight, group)
    layer.weight = nn.Parameter(packed, requires_grad=False)
    layer.scales = scales


def quantize_projection(layer: Linear, quantization: str) -> None:
    """A decoder layer's (or an expert's) projection quantised as `quantization` says (`none`: unchanged)."""
    if quantization == "int8":
        quantize_linear(layer)
    elif quantization == "int4":
        quantize_linear_int4(layer)
