"""The linear layers of a stage, with a native kernel for the few rows of a decode step on CPU.

At one to a few dozen rows a linear layer streams its weights: each is read once and used once per row, so it
should take the weight bytes over the memory bandwidth. PyTorch's CPU path does not get there at every shape
and dtype. Measured on SmolLM2's shapes with whole-model weights streamed, 2 threads (docs/performance.md, "One
request and moderate load"): at one row float32 runs as MKL does (23-24 GB/s) and faster at 2-8 rows (0.66-0.83x
the time), bfloat16 at 21 GB/s against oneDNN's 8, int8 at 15 against `_weight_int8pack_mm`'s 2. With more rows a
step is compute-bound and MKL/oneDNN's blocking usually wins (int8 then multiplies a float copy of the weight made
per call, one layer at a time).

`Linear` is `nn.Linear` (the same parameter names, so loading and tensor parallelism are unchanged) whose
`forward` asks its `paths` (a strategy: row count -> path) which of `PATHS` a call takes. `prepare()` gives it
`FixedPaths`, thresholds per weight dtype measured on one Intel host (`MAX_ROWS`, `WIDEN_ROWS`); a stage then
replaces them by the paths it times on its own CPU (`kernels/linear_tuning.py`, cached), unless
`--linear-tuning off`. Either way the choice is made once, so the same batch always takes the same arithmetic
in a process. Within the kernel each output's sum is formed in the same order whatever the batch, so a row's
result does not depend on the other rows. `RINGSCHED_NATIVE_LINEAR=0` turns the kernel off (int8 then takes
torch's path everywhere).

bfloat16 steps of many rows are compute-bound, and without AMX oneDNN's bfloat16 matmul runs at about half of
MKL's float32 rate on the same cores (measured on an AVX-512 Xeon without AMX, SmolLM2's shapes, 1 and 2 threads:
67-83 against 92-145 GFLOP/s). So on such a CPU a bfloat16 layer given at least `WIDEN_ROWS` rows widens its
weight to float32 for the call and multiplies with MKL: 0.62-0.80x the time from 128 rows up (a widened weight is
at most a few MiB, made and dropped per call; both paths sum in float32 and round the result to bfloat16).
Where the CPU has AMX, oneDNN's bfloat16 kernels are the fast path and are kept.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ringsched.kernels import native_build

logger = logging.getLogger(__name__)

ENV_SWITCH = "RINGSCHED_NATIVE_LINEAR"
SOURCE = Path(__file__).with_name("small_linear.c")
HEADERS = tuple(SOURCE.with_name(f"small_linear_{h}.h") for h in ("int4", "avx2"))  # included by SOURCE
SOURCES = (SOURCE, *HEADERS)  # what the built library is made of (a tuning cache is keyed by them)
# -fopenmp on both lines: the library then needs libgomp.so.1, which the dynamic linker resolves to the copy
# torch has already loaded (same soname), so the kernel runs on torch's own thread team. The headers' hash is a
# flag: the build cache is keyed by the source and the flags, so a change to a header rebuilds too.
_HEADERS_HASH = hashlib.sha256(b"".join(h.read_bytes() for h in HEADERS)).hexdigest()[:16]
COMPILE_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", f"-DHEADERS_HASH={_HEADERS_HASH}", "-c"]
LINK_FLAGS = ["-shared", "-fopenmp"]

_W_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}
_INT4_CODE = {32: 3, 128: 4}  # int4 (packed uint8 weights) by group size: the group is in the kernel's type code
# A call's paths: the kernel; torch's `F.linear` (MKL/oneDNN; int8: of a float copy of the weight); bfloat16
# widened to float32 (MKL's sgemm); int8 by `torch._weight_int8pack_mm`.
NATIVE, TORCH, WIDEN, INT8PACK = "native", "torch", "widen", "int8pack"
PATHS = (NATIVE, TORCH, WIDEN, INT8PACK)
# Without tuning (`--linear-tuning off`): rows up to which the kernel is used, by weight dtype (measured on an
# Intel host: docs/performance.md, "One request and moderate load").
# int4: the kernel up to 64 rows; beyond, dequantizing per call then MKL wins (SmolLM2's shapes, 2 threads, Xeon with
# AVX-512: 3.6 against 4.5 ms per layer's four linears at 64 rows, 7.0 against 5.0 at 128)
INT4_MAX_ROWS = 64
MAX_ROWS = {torch.float32: 8, torch.bfloat16: 16, torch.int8: 32, torch.uint8: INT4_MAX_ROWS}
# bfloat16 steps of at least this many rows widen to float32 on CPUs without AMX (measured at 64 rows: 0.80-1.10x
# the time, so not there); RINGSCHED_BF16_WIDEN_ROWS sets it, 0 turns widening off
WIDEN_ROWS = int(os.environ.get("RINGSCHED_BF16_WIDEN_ROWS", "128"))

_lock = threading.Lock()
_state: dict[str, object] = {}


def enabled() -> bool:
    return native_build.switched_on(ENV_SWITCH)


def library() -> ctypes.CDLL | None:
    """The loaded kernel, or None (disabled, no compiler, build failed): decided once per process."""
    return LIBRARY.get()


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.linear_kn.argtypes = [ptr, i64, i64, i64, i64, ptr, i64, i64, ptr, ptr, i64, i64]
    lib.linear_nk.argtypes = [ptr, i64, i64, i64, i64, ptr, i64, ptr, i64, ptr, ptr, i64, i64]
    lib.linear_kn.restype = lib.linear_nk.restype = ctypes.c_int
    return lib


LIBRARY = native_build.NativeLibrary(
    SOURCE, COMPILE_FLAGS, LINK_FLAGS, logger, "linear layers", "using torch's path", _declare, ENV_SWITCH
)


def has_amx() -> bool:
    """Whether this CPU has AMX's bfloat16 tiles (Linux: the `amx_bf16` flag in /proc/cpuinfo)."""
    with _lock:
        if "amx" not in _state:
            _state["amx"] = "amx_bf16" in native_build._cpu_flags().split()
        return bool(_state["amx"])


def widened_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear` of bfloat16 `x` and `weight` computed in float32 (MKL's sgemm), rounded back to bfloat16;
    `bias` float32 or None."""
    return F.linear(x.float(), weight.float(), bias).to(x.dtype)


def weight_code(weight: torch.Tensor, scales: torch.Tensor | None, k: int) -> int:
    """The kernel's type code of `weight` for inputs of `k` features (int4: packed uint8, its group from `scales`)."""
    if weight.dtype == torch.uint8:
        return _INT4_CODE[k // scales.shape[1]]
    return _W_CODE[weight.dtype]


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Packed int4 [N, K/2] uint8 and scales [N, K/G] float32 (`quantize.quantize_int4_weight`) -> [N, K] in
    `dtype`: each block of 32 k holds value j in byte j's low nibble and j + 16 in its high nibble, stored q + 8."""
    n, half = packed.shape
    b = packed.view(n, half // 16, 16)
    q = torch.empty(n, half // 16, 32)  # [N, K/32, 32], filled in place: 4x faster than cat then convert
    q[:, :, :16] = b & 0x0F
    q[:, :, 16:] = b >> 4
    w = q.view(n, scales.shape[1], -1).sub_(8).mul_(scales[:, :, None])
    return w.view(n, 2 * half).to(dtype)


def native_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, scales: torch.Tensor | None = None
) -> torch.Tensor:
    """`x @ weight.T (* scales) + bias` by the kernel. `x` [M, K] float32 or bfloat16 with unit stride along K;
    `weight` [N, K] float32, bfloat16 or int8 (then `scales` [N] float32), or int4 packed [N, K/2] uint8 (then
    `scales` [N, K/G] float32), either contiguous or (float32) the transposed layout `cpu_layout` gives; `bias`
    [N] float32. Returns [M, N] in `x`'s dtype."""
    lib = library()
    assert lib is not None, "native_linear called without the kernel"
    m, k = x.shape
    n = weight.shape[0]
    if x.stride(1) != 1:
        x = x.contiguous()
    y = torch.empty(m, n, dtype=x.dtype)
    xb = int(x.dtype == torch.bfloat16)
    b = None if bias is None else bias.data_ptr()
    threads = torch.get_num_threads()
    if weight.stride() == (1, n) and weight.dtype == torch.float32:  # [K, N] in memory
        rc = lib.linear_kn(x.data_ptr(), x.stride(0), xb, m, k, weight.data_ptr(), n, n, b, y.data_ptr(), xb, threads)
    else:
        assert weight.is_contiguous(), "native_linear takes [N, K] or [K, N] weights"
        s = None if scales is None else scales.data_ptr()
        rc = lib.linear_nk(
            x.data_ptr(),
            x.stride(0),
            xb,
            m,
            k,
            weight.data_ptr(),
            weight_code(weight, scales, k),
            s,
            n,
            b,
            y.data_ptr(),
            xb,
            threads,
        )
    if rc != 0:
        raise ValueError(f"native_linear: unsupported weight dtype {weight.dtype} (int4: K a multiple of the group)")
    return y


class Paths(Protocol):
    """A linear layer's strategy: which of `PATHS` a call of `rows` rows takes (the same answer every call)."""

    def path(self, rows: int) -> str: ...


@dataclass(frozen=True)
class FixedPaths:
    """The fixed thresholds: the kernel up to `max_rows` rows, bfloat16 widened from `widen_rows` rows (0: never),
    torch otherwise."""

    max_rows: int = 0
    widen_rows: int = 0

    def path(self, rows: int) -> str:
        if rows <= self.max_rows:
            return NATIVE
        return WIDEN if self.widen_rows and rows >= self.widen_rows else TORCH


def apply(
    path: str,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    bias_f32: torch.Tensor | None,
    scales: torch.Tensor | None,
) -> torch.Tensor:
    """`x @ weight.T (* scales) + bias` by `path` (torch's where `x` is not a float32 or bfloat16 matrix);
    `bias_f32` is `bias` in float32 (the kernel's and widening's)."""
    if path != TORCH and (x.dim() != 2 or x.dtype not in (torch.float32, torch.bfloat16)):
        path = TORCH
    if path == NATIVE:
        return native_linear(x, weight, bias_f32, scales)
    if path == WIDEN:
        return widened_linear(x, weight, bias_f32)
    if path == INT8PACK:
        y = torch._weight_int8pack_mm(x, weight, scales.to(x.dtype))  # scales in the activations' dtype
        return y if bias is None else y + bias
    if weight.dtype == torch.int8:
        weight = weight.to(x.dtype) * scales.to(x.dtype)[:, None]
    elif weight.dtype == torch.uint8:  # int4: dequantized per call (one layer at a time), then MKL/oneDNN
        weight = dequantize_int4(weight, scales, x.dtype)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """`nn.Linear` whose calls take the path its `paths` names for their row count. `prepare()` (after the
    weights are loaded) gives it `FixedPaths`: torch only off CPU, for dtypes the kernel lacks, or without the
    kernel; `kernels/linear_tuning.py` may then replace them by measured ones. An int8 layer (`quantize_int8`)
    holds `weight` int8 [N, K] and `scales` float32 [N]; an int4 one (`quantize_linear_int4`) `weight` uint8
    [N, K/2] (two values a byte) and `scales` float32 [N, K/G]."""

    paths: Paths = FixedPaths()
    scales: torch.Tensor | None = None
    bias_f32: torch.Tensor | None = None  # the kernel adds a float32 bias
    qtype = 0  # the GGUF type of a weight kept as a GGUF tensor's blocks (`weights/gguf_kept.py`); 0: not one
    vocab_chunk = 0  # a vocabulary head's rows per call (`models/vocab.py`'s `LMHead`); 0: the whole weight at once

    def weight_kind(self) -> str:
        """The weight's format as the tuning cache names it: its dtype, or int4 by its group (`int4g32`)."""
        if self.weight.dtype == torch.uint8:
            return f"int4g{self.in_features // self.scales.shape[1]}"
        return str(self.weight.dtype).removeprefix("torch.")

    def native_words(self) -> list[int]:
        """The layer as the one-call decode reads it (`decode_layers.c`): form (0: float32 `[K, N]`, 1: `[N, K]`),
        weight, its code, scales, bias, N, K."""
        w = self.weight
        n, k = w.shape[0], self.in_features  # int4: the weight is [N, K/2] bytes
        kn = w.dtype == torch.float32 and w.stride() == (1, n)
        assert kn or w.is_contiguous(), "the kernel takes [N, K] or (float32) [K, N] weights"
        scales = 0 if self.scales is None else self.scales.data_ptr()
        bias = 0 if self.bias_f32 is None else self.bias_f32.data_ptr()
        return [0 if kn else 1, w.data_ptr(), weight_code(w, self.scales, k), scales, bias, n, k]

    def give_format(self, fused: Linear) -> None:
        """Give `fused`, whose weight is this layer's rows joined with others like it, this layer's weight format
        (a plain weight needs nothing)."""

    def prepare(self) -> None:
        w = self.weight
        usable = w.device.type == "cpu" and w.dtype in MAX_ROWS and library() is not None
        widen = w.device.type == "cpu" and w.dtype == torch.bfloat16 and WIDEN_ROWS > 0 and not has_amx()
        self.paths = FixedPaths(MAX_ROWS[w.dtype] if usable else 0, WIDEN_ROWS if widen else 0)
        self.bias_f32 = None if self.bias is None else self.bias.detach().float()

    def batch_invariant(self) -> bool:
        """Take the kernel at every row count, where it runs (its rows are bit-invariant: a row's result does not
        depend on the others); False where it does not."""
        if self.paths.path(1) != NATIVE:
            return False
        self.paths = FixedPaths(max_rows=sys.maxsize)
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        path = self.paths.path(x.shape[0]) if x.dim() == 2 else TORCH
        return self.run(x, path)

    def run(self, x: torch.Tensor, path: str) -> torch.Tensor:
        return apply(path, x, self.weight, self.bias, self.bias_f32, self.scales)

    def run_rows(self, x: torch.Tensor, rows: slice, path: str) -> torch.Tensor:
        """`x` times output rows `rows` of the weight, without the bias (the lm_head's vocabulary chunks)."""
        return apply(path, x, self.weight[rows], None, None, None if self.scales is None else self.scales[rows])
