"""The GGUF kernel (`gguf_linear.c`): a GGUF tensor's blocks, kept as the file stores them (`--quantization gguf`,
`weights/gguf_kept.py`), times the activations.

A quantized tensor stays the file's blocks: a `[rows, row_bytes]` uint8 tensor whose row `r` is the blocks of the
weight's row `r` (GGUF quantizes along the input dimension, so rows are independent: a stage, a tensor-parallel
rank or a fused q/k/v takes whole rows, and a row-parallel rank a run of whole blocks of each row). `gguf_matmul`
decodes each block in registers, for the few rows of a decode step (the weight is streamed once, at its quantized
size); `dequantize` (also native) serves a step of many rows, which MKL/oneDNN then multiply (where the CPU has
AMX, the 32-value-block types take the kernel's tiles at every row count: `max_rows`); a stage times both on its
CPU (`kernels/linear_tuning.py`). Types: `TYPES`. Without a C compiler the `gguf` package's reference
dequantization serves every path (slowly).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import sys
from pathlib import Path

import numpy as np
import torch

from ringsched.kernels import native_build

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("gguf_linear.c")
HEADER = SOURCE.with_name("gguf_linear_vnni.h")  # included by SOURCE: its hash is a flag, so a change rebuilds
AMX_HEADER = SOURCE.with_name("gguf_linear_amx.h")  # likewise (hashed with HEADER)
DOT_HEADER = SOURCE.with_name("gguf_linear_avx2dot.h")  # likewise
# what the built library is made of (a tuning cache is keyed by them)
SOURCES = (SOURCE, HEADER, AMX_HEADER, DOT_HEADER)
_HEADERS_HASH = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES[1:])).hexdigest()[:16]
COMPILE_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", f"-DHEADERS_HASH={_HEADERS_HASH}", "-c"]
LINK_FLAGS = ["-shared", "-fopenmp"]
ENV_SWITCH = "RINGSCHED_NATIVE_LINEAR"
# Integer dot products with int8 activations, as llama.cpp multiplies: the 32-value-block types at few rows where
# the CPU has AVX512-VNNI, every type at any rows where it has AVX2 and no AVX-512; from 8 rows AMX tiles where it
# has them (activations as two bfloat16 halves: float32's accuracy, in another order); 0: in float32, exactly as
# the dequantized weights
INTEGER_SWITCH = "RINGSCHED_GGUF_INTEGER"

# ggml's type number -> (name, values per block, bytes per block)
TYPES = {
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
}
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


LIBRARY = native_build.NativeLibrary(
    SOURCE,
    COMPILE_FLAGS,
    LINK_FLAGS,
    logger,
    "GGUF linear layers",
    "dequantizing with the gguf package",
    _declare,
    ENV_SWITCH,
)


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
        raise ValueError(
            f"{what}: splitting {k} inputs of a {name} weight at {start}:{stop} would cut its "
            f"{values}-value blocks; --tp-size must divide it in whole blocks: {fits}"
        )
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
    rc = lib.gguf_linear(
        x.data_ptr(), x.stride(0), xb, m, k, raw.data_ptr(), qtype, n, b, y.data_ptr(), xb, torch.get_num_threads()
    )
    if rc != 0:
        raise ValueError(f"gguf_linear: type {qtype} with {k} inputs")
    return y
