"""GGUF-quantized weights kept as the file stores them (`--quantization gguf`): a linear layer whose `weight` is a
GGUF tensor's blocks (`GGUFWeights`, mixed into the layer's own type by `keep`), and projections of different types
side by side as one layer (`GGUFParts`). Each answers what the rest of the engine asks of a layer through
`Linear`'s methods (its paths, its name in the tuning cache, its words for the one-call decode, what a fusion of
its rows is), so no other package asks which kind of weight it holds. The kernel is `kernels/gguf_linear.py`."""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn

from ringsched.kernels.gguf_linear import dequantize, gguf_matmul, library, max_rows, type_name
from ringsched.kernels.small_linear import NATIVE, FixedPaths, Linear


class GGUFWeights:
    """Mixed into a `Linear` (or its tensor-parallel or lm_head kinds) whose `weight` is a GGUF tensor's blocks,
    `[out, row_bytes]` uint8 of type `qtype` (`in_features` stays the number of inputs); made in place by `keep`."""

    def kinds(self) -> list[GGUFWeights]:
        """The layers whose blocks this one's weight is: itself (`GGUFParts`: its parts)."""
        return [self]

    def prepare(self) -> None:
        super().prepare()
        self.paths = FixedPaths(max_rows([p.qtype for p in self.kinds()]))

    def weight_kind(self) -> str:
        """Named by its GGUF type(s): `gguf-Q4_0`, `gguf-Q5_0+Q5_0+Q8_0`."""
        return "gguf-" + "+".join(type_name(p.qtype) for p in self.kinds())

    def native_words(self) -> list[int]:
        """Form 2: one GGUF type's blocks (`gguf_linear.c`)."""
        bias = 0 if self.bias_f32 is None else self.bias_f32.data_ptr()
        return [2, self.weight.data_ptr(), self.qtype, 0, bias, self.weight.shape[0], self.in_features]

    def give_format(self, fused: Linear) -> None:
        """Rows of one GGUF type joined: the fused rows are its blocks too."""
        keep(fused, fused.weight, self.qtype)

    def batch_invariant(self) -> bool:
        """The kernel at every row count, in float32 (the integer path takes only a few rows without AMX, and sums a
        row alone (VNNI) in another order than rows together (AMX tiles): a row's result would depend on how many
        share its step)."""
        lib = library()
        if lib is None:
            return False
        lib.gguf_set_integer(0)
        self.paths = FixedPaths(max_rows=sys.maxsize)
        return True

    def run(self, x: torch.Tensor, path: str) -> torch.Tensor:
        return self.run_rows(x, slice(None), path)

    def run_rows(self, x: torch.Tensor, rows: slice, path: str) -> torch.Tensor:
        """`x` times output rows `rows` of the weight (no bias: the lm_head's vocabulary chunks)."""
        w = self.weight[rows]
        whole = rows == slice(None)
        if path == NATIVE and x.dim() == 2 and x.dtype in (torch.float32, torch.bfloat16):
            return gguf_matmul(x, w, self.qtype, self.bias_f32 if whole else None)
        return F.linear(x, dequantize(w, self.qtype, self.in_features, x.dtype), self.bias if whole else None)


_KINDS: dict[type, type] = {}


def keep(lin: Linear, raw: torch.Tensor, qtype: int) -> Linear:
    """`lin` holding the GGUF blocks `raw` of type `qtype` in place of its weight, its class given `GGUFWeights`."""
    base = type(lin)
    if not issubclass(base, GGUFWeights):
        if base not in _KINDS:
            _KINDS[base] = type(f"GGUF{base.__name__}", (GGUFWeights, base), {})
        lin.__class__ = _KINDS[base]
    lin.weight = nn.Parameter(raw.contiguous(), requires_grad=False)
    lin.qtype = qtype
    return lin


class GGUFParts(GGUFWeights, Linear):
    """Kept projections of different GGUF types side by side as one layer (q/k/v where llama.cpp gave v more bits):
    each part keeps its own blocks; the kernel writes each part's outputs into its columns of one output
    (`gguf_linear_parts`), so the layer still takes the one-call decode as a fused one does."""

    def __init__(self, parts: list[Linear]) -> None:
        bias = parts[0].bias is not None
        super().__init__(parts[0].in_features, sum(p.out_features for p in parts), bias=bias, device="meta")
        self.__dict__["parts"] = parts  # not submodules: the state dict keeps the parts' own names
        self.desc = torch.tensor([[p.weight.data_ptr(), p.qtype, p.out_features] for p in parts], dtype=torch.int64)
        if bias:
            self.bias = nn.Parameter(torch.cat([p.bias.detach() for p in parts]), requires_grad=False)

    def kinds(self) -> list[GGUFWeights]:
        return self.parts

    def native_words(self) -> list[int]:
        """Form 3: parts of several GGUF types (`gguf_linear.c`)."""
        bias = 0 if self.bias_f32 is None else self.bias_f32.data_ptr()
        return [3, self.desc.data_ptr(), len(self.parts), 0, bias, self.out_features, self.in_features]

    def run_rows(self, x: torch.Tensor, rows: slice, path: str) -> torch.Tensor:
        lib = library()
        if path == NATIVE and rows == slice(None) and x.dim() == 2 and x.dtype in (torch.float32, torch.bfloat16):
            x = x if x.stride(1) == 1 else x.contiguous()
            y = torch.empty(x.shape[0], self.out_features, dtype=x.dtype)
            xb = int(x.dtype == torch.bfloat16)
            b = None if self.bias_f32 is None else self.bias_f32.data_ptr()
            if (
                lib.gguf_linear_parts(
                    x.data_ptr(),
                    x.stride(0),
                    xb,
                    x.shape[0],
                    x.shape[1],
                    self.desc.data_ptr(),
                    len(self.parts),
                    b,
                    y.data_ptr(),
                    xb,
                    torch.get_num_threads(),
                )
                == 0
            ):
                return y
        w = torch.cat([dequantize(p.weight, p.qtype, self.in_features, x.dtype) for p in self.parts])[rows]
        return F.linear(x, w, self.bias if rows == slice(None) else None)


def fuse_kept(parts: list[nn.Linear]) -> Linear | None:
    """`parts` of different GGUF types as one `GGUFParts` layer, prepared; None (each part prepared on its own)
    when some part is not a kept GGUF weight."""
    if not all(p.qtype for p in parts):
        for p in parts:
            p.prepare()
        return None
    fused = GGUFParts(parts)
    fused.prepare()
    return fused


def same_type(parts: list[nn.Linear]) -> bool:
    """Whether `parts` (a fusion group) are all kept GGUF weights of one type, or none is: only then can they be
    fused (rows of different types cannot share one weight)."""
    return len({p.qtype for p in parts}) == 1
