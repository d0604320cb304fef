"""GGUF-quantized weights kept as the file stores them (`--model FILE.gguf`, `--quantization gguf`).

A quantized tensor stays the file's blocks: a `[rows, row_bytes]` uint8 tensor whose row `r` is the blocks of the
weight's row `r` (GGUF quantizes along the input dimension, so rows are independent: a stage, a tensor-parallel
rank or a fused q/k/v takes whole rows, and a row-parallel rank a run of whole blocks of each row). `GGUFLinear`
multiplies it by `gguf_linear.c`, which decodes each block in registers, for the few rows of a decode step (the
weight is streamed once, at its quantized size), and dequantizes it (also natively) for a step of many rows, which
MKL/oneDNN then multiply (where the CPU has AMX, the 32-value-block types take the kernel's tiles at every row count:
`max_rows`); a stage times both on its CPU (`models/linear_tuning.py`). `GGUFEmbedding` dequantizes
the rows it looks up. Types: `TYPES`. Without a C compiler the `gguf` package's reference dequantization serves
every path (slowly).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ringsched.models import native_build
from ringsched.models.small_linear import NATIVE, FixedPaths, Linear

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("gguf_linear.c")
HEADER = SOURCE.with_name("gguf_linear_vnni.h")  # included by SOURCE: its hash is a flag, so a change rebuilds
AMX_HEADER = SOURCE.with_name("gguf_linear_amx.h")  # likewise (hashed with HEADER)
SOURCES = (SOURCE, HEADER, AMX_HEADER)  # what the built library is made of (a tuning cache is keyed by them)
_HEADERS_HASH = hashlib.sha256(HEADER.read_bytes() + AMX_HEADER.read_bytes()).hexdigest()[:16]
COMPILE_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", f"-DHEADERS_HASH={_HEADERS_HASH}",
                 "-c"]  # fmt: skip
LINK_FLAGS = ["-shared", "-fopenmp"]
ENV_SWITCH = "RINGSCHED_NATIVE_LINEAR"
# The 32-value-block types by integer dot products with int8 activations where the CPU has AVX512-VNNI (as
# llama.cpp multiplies them), and from 8 rows by AMX tiles where it has them (activations as two bfloat16 halves:
# float32's accuracy, in another order); 0: in float32, exactly as the dequantized weights
INTEGER_SWITCH = "RINGSCHED_GGUF_INTEGER"

# ggml's type number -> (name, values per block, bytes per block)
TYPES = {2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34),
         12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210)}  # fmt: skip
# Rows up to which a call takes the kernel; beyond, the weight is dequantized for the call and MKL multiplies (a
# step of many rows is compute-bound). Measured on SmolLM2's shapes, Q4_0 and Q8_0, 2 threads, Xeon with AVX-512:
# the kernel 2.6 against 4.1 ms at 16 rows, level at 32, 10.4 against 8.6 at 64. The fixed choice (`--linear-tuning
# off`); a stage otherwise times both paths per row bucket. Multiplying in bfloat16 (AMX: 4x float32's rate at 64
# rows) rounds too coarsely (greedy tokens of 2 prompts in 8 differed from the dequantized weights'); float16 runs
# at float32's rate on CPUs without AMX-FP16.
MAX_ROWS = 32
# Where the CPU has AMX (`gguf_has_amx`) and INTEGER_SWITCH is on, the 32-value-block types run on tiles from 8
# rows (`gguf_linear_amx.h`), faster than dequantize+MKL at every row count measured (a SmolLM2 layer's qkv, o,
# gate_up and down, 2 threads, Q8_0: 0.85 against 2.3 ms at 64 rows, 2.7 against 5.8 at 256, 10.7 against 19.6 at
# 1024; Q4_0 alike), so the kernel takes them all. The K-quants still take the float tiles, which MKL beats past
# MAX_ROWS.
AMX_MAX_ROWS = sys.maxsize


def max_rows(qtypes: list[int]) -> int:
    """Rows up to which weights of types `qtypes` (side by side: `GGUFParts`) take the kernel (0: no kernel)."""
    lib = library()
    if lib is None:
        return 0
    tiles = lib.gguf_has_amx() and native_build.switched_on(INTEGER_SWITCH)
    return min(AMX_MAX_ROWS if tiles and TYPES[t][1] == 32 else MAX_ROWS for t in qtypes)


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.gguf_linear.argtypes = [ptr, i64, i64, i64, i64, ptr, i64, i64, ptr, ptr, i64, i64]
    lib.gguf_linear_parts.argtypes = [ptr, i64, i64, i64, i64, ptr, i64, ptr, ptr, i64, i64]
    lib.gguf_linear_parts.restype = ctypes.c_int
    lib.gguf_dequant.argtypes = [ptr, i64, i64, i64, ptr, i64]
    lib.gguf_linear.restype = lib.gguf_dequant.restype = lib.gguf_has_integer.restype = ctypes.c_int
    lib.gguf_has_amx.restype = ctypes.c_int
    lib.gguf_set_integer.argtypes = [i64]
    lib.gguf_set_integer(int(native_build.switched_on(INTEGER_SWITCH)))
    return lib


LIBRARY = native_build.NativeLibrary(SOURCE, COMPILE_FLAGS, LINK_FLAGS, logger, "GGUF linear layers",
                                     "dequantizing with the gguf package", _declare, ENV_SWITCH)  # fmt: skip


def library() -> ctypes.CDLL | None:
    return LIBRARY.get()


def type_name(qtype: int) -> str:
    return TYPES[qtype][0]


def row_bytes(qtype: int, k: int) -> int:
    """Bytes of one row of `k` values of type `qtype` (`k` a whole number of blocks)."""
    _, values, nbytes = TYPES[qtype]
    return k // values * nbytes


def column_bytes(qtype: int, start: int, stop: int, k: int, what: str) -> tuple[int, int]:
    """Byte range of values `[start, stop)` of each row: a run of whole blocks, else a ValueError naming `what` (the
    tensor-parallel split that would cut a block) and the sizes that fit."""
    name, values, nbytes = TYPES[qtype]
    if start % values or stop % values:
        fits = [n for n in range(1, 9) if (k // n) % values == 0 and k % n == 0]
        raise ValueError(f"{what}: splitting {k} inputs of a {name} weight at {start}:{stop} would cut its "
                         f"{values}-value blocks; --tp-size must divide it in whole blocks: {fits}")  # fmt: skip
    return start // values * nbytes, stop // values * nbytes


def dequantize(raw: torch.Tensor, qtype: int, k: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`raw` [N, row_bytes] of type `qtype` -> [N, k] in `dtype`."""
    lib = library()
    raw = raw.contiguous()
    if lib is None:
        import gguf  # the reference: the gguf package's numpy dequantization

        arr = gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType(qtype))
        return torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32)).to(dtype)
    out = torch.empty(raw.shape[0], k, dtype=torch.float32)
    if lib.gguf_dequant(raw.data_ptr(), qtype, raw.shape[0], k, out.data_ptr(), torch.get_num_threads()) != 0:
        raise ValueError(f"gguf_dequant: type {qtype} with {k} inputs")
    return out if dtype == torch.float32 else out.to(dtype)


def gguf_matmul(x: torch.Tensor, raw: torch.Tensor, qtype: int, bias_f32: torch.Tensor | None) -> torch.Tensor:
    """`x @ W.T + bias` by the kernel: `x` [M, K] float32 or bfloat16, `raw` [N, row_bytes] contiguous."""
    lib = library()
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    n = raw.shape[0]
    y = torch.empty(m, n, dtype=x.dtype)
    xb = int(x.dtype == torch.bfloat16)
    b = None if bias_f32 is None else bias_f32.data_ptr()
    rc = lib.gguf_linear(x.data_ptr(), x.stride(0), xb, m, k, raw.data_ptr(), qtype, n, b, y.data_ptr(), xb,
                         torch.get_num_threads())  # fmt: skip
    if rc != 0:
        raise ValueError(f"gguf_linear: type {qtype} with {k} inputs")
    return y


class GGUFWeights:
    """Mixed into a `Linear` (or its tensor-parallel or lm_head kinds) whose `weight` is a GGUF tensor's blocks,
    `[out, row_bytes]` uint8 of type `qtype` (`in_features` stays the number of inputs); made in place by `keep`."""

    qtype: int = 0

    def prepare(self) -> None:
        super().prepare()
        kinds = self.parts if isinstance(self, GGUFParts) else [self]
        self.paths = FixedPaths(max_rows([p.qtype for p in kinds]))

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

    def run_rows(self, x: torch.Tensor, rows: slice, path: str) -> torch.Tensor:
        lib = library()
        if path == NATIVE and rows == slice(None) and x.dim() == 2 and x.dtype in (torch.float32, torch.bfloat16):
            x = x if x.stride(1) == 1 else x.contiguous()
            y = torch.empty(x.shape[0], self.out_features, dtype=x.dtype)
            xb = int(x.dtype == torch.bfloat16)
            b = None if self.bias_f32 is None else self.bias_f32.data_ptr()
            if lib.gguf_linear_parts(x.data_ptr(), x.stride(0), xb, x.shape[0], x.shape[1], self.desc.data_ptr(),
                                     len(self.parts), b, y.data_ptr(), xb, torch.get_num_threads()) == 0:  # fmt: skip
                return y
        w = torch.cat([dequantize(p.weight, p.qtype, self.in_features, x.dtype) for p in self.parts])[rows]
        return F.linear(x, w, self.bias if rows == slice(None) else None)


def fuse_kept(parts: list[nn.Linear]) -> Linear | None:
    """`parts` of different GGUF types as one `GGUFParts` layer, prepared; None (each part prepared on its own)
    when some part is not a kept GGUF weight."""
    if not all(isinstance(p, GGUFWeights) for p in parts):
        for p in parts:
            p.prepare()
        return None
    fused = GGUFParts(parts)
    fused.prepare()
    return fused


def same_type(parts: list[nn.Linear]) -> bool:
    """Whether `parts` (a fusion group) are all kept GGUF weights of one type, or none is: only then can they be
    fused (rows of different types cannot share one weight)."""
    kinds = {p.qtype if isinstance(p, GGUFWeights) else 0 for p in parts}
    return len(kinds) == 1
