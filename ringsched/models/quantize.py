"""Weight-only int8 quantisation (`--quantization int8`): each output row of a projection stored as int8 with
one float32 scale, symmetric (`w ~= q * scale`, `q` in [-127, 127], `scale = max|w_row| / 127`).

Activations, the KV cache, norms and the embedding stay in the model dtype; the lm_head is quantised too (on a
small model with a tied embedding it is a fifth of the weights), the embedding it is tied to is not (a row is
read per token). What it costs in accuracy is measured by `scripts/check_quantization.py`.
"""

from __future__ import annotations

import torch
from torch import nn

from ringsched.models.small_linear import Linear

QUANTIZATIONS = ("none", "int8")


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
