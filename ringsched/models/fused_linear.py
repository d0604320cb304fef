"""A decoder layer's projections as the CPU multiplies them fastest: float32 weights stored `[in, out]`
(`cpu_layout`), and q/k/v and gate/up fused into one linear layer each (`fuse_linears`) whose parts stay views
of it, so names, shapes and memory are unchanged.
"""

from __future__ import annotations

import torch
from torch import nn

from ringsched.kernels.small_linear import Linear


def cpu_layout(name: str, weight: torch.Tensor) -> torch.Tensor:
    """A decoder layer's projection weight stored `[in, out]` in memory (the same `[out, in]` tensor with
    transposed strides) when it is float32 on a CPU: MKL's sgemm then multiplies without transposing the
    weight, which measured (one thread, SmolLM2 shapes) 10-30% faster at 64-128 rows with the same results bit
    for bit; a whole decode step of 86 rows 13% faster, of 128 rows 7%. The lm_head keeps its layout (no gain
    measured; tied, it is the embedding's rows). Names and shapes do not change. Other tensors: unchanged."""
    if name.startswith("model.layers.") and name.endswith(("_proj.weight", ".w1.weight", ".w2.weight", ".w3.weight")):
        return _kn_storage(weight)  # q/k/v/o, gate/up/down, and Mixtral's experts' w1 (gate), w3 (up), w2 (down)
    return weight


def _kn_storage(weight: torch.Tensor) -> torch.Tensor:
    if weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2:
        return weight.t().contiguous().t()
    return weight


def fuse_linears(parts: list[nn.Linear]) -> Linear:
    """One `Linear` whose output is the parts' outputs side by side (q/k/v, or gate/up): one weight stream and one
    call instead of several. The parts' parameters become views of the fused ones (names, shapes and memory
    unchanged); the fused layer is not a submodule, so the state dict keeps the checkpoint's names."""
    w = _joined([p.weight for p in parts])
    if w is None:
        w = _kn_storage(torch.cat([p.weight.detach() for p in parts]))
    fused = Linear(parts[0].in_features, w.shape[0], bias=parts[0].bias is not None, device="meta")
    fused.weight = nn.Parameter(w, requires_grad=False)
    parts[0].give_format(fused)  # rows of one GGUF type: the fused rows are its blocks too
    if parts[0].bias is not None:
        b = _joined([p.bias for p in parts])
        b = b if b is not None else torch.cat([p.bias.detach() for p in parts])
        fused.bias = nn.Parameter(b, requires_grad=False)
    share_rows(fused, parts)
    return fused


def _joined(ts: list[torch.Tensor]) -> torch.Tensor | None:
    """The tensors as one, without a copy, when they are consecutive row ranges of one buffer (the loader puts
    the parts of a fused projection there); else None."""
    first = ts[0]
    offset = first.storage_offset()
    for t in ts:
        same = t.untyped_storage().data_ptr() == first.untyped_storage().data_ptr() and t.stride() == first.stride()
        if not same or t.storage_offset() != offset:
            return None
        offset += t.shape[0] * t.stride(0)
    rows = sum(t.shape[0] for t in ts)
    return first.detach().as_strided((rows, *first.shape[1:]), first.stride(), first.storage_offset())


def share_rows(fused: Linear, parts: list[nn.Linear]) -> None:
    """Point each part's weight (bias, scales) at its rows of the fused layer's: rows of int8's per-row scales,
    or of int4's packed [N, K/2] weight and [N, K/G] group scales alike."""
    start = 0
    for p in parts:
        rows = slice(start, start + p.out_features)
        p.weight = nn.Parameter(fused.weight[rows], requires_grad=False)
        if p.bias is not None:
            p.bias = nn.Parameter(fused.bias[rows], requires_grad=False)
        if fused.scales is not None:
            p.scales = fused.scales[rows]
        start += p.out_features
