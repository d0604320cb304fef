"""The CPU decode-attention kernel (`paged_decode.c`): compiled on first use with the system's C compiler,
cached, loaded with ctypes; without a compiler everything runs on the torch path.

Why a kernel: profiles of a saturated SmolLM2 stage (128 decodes at context ~192, one thread) spent 45% of a
decode layer in attention, 5.1 ms gathering each request's K/V blocks into a padded copy and 3.5 ms in
`scaled_dot_product_attention` over it. Reading the blocks in place takes 3.3 ms for the same work (2.0 ms on
two threads): the copy, its write and the padding were memory traffic, the one thing a CPU decode is short of.

Built by `native_build` into `$RINGSCHED_CACHE/native/`. `RINGSCHED_NATIVE_ATTENTION=0` turns it off.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from ringsched.kernels import native_build

logger = logging.getLogger(__name__)

ENV_SWITCH = "RINGSCHED_NATIVE_ATTENTION"
SOURCE = Path(__file__).with_name("paged_decode.c")
# -ffast-math lets gcc vectorise expf (glibc's libmvec) and the dot products; it is given to the compile step
# only: on the link line gcc < 13 would add crtfastmath.o, which turns on flush-to-zero for the whole process.
# -fopenmp on both lines: the rows are split over torch's own thread team (libgomp.so.1, already loaded).
COMPILE_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-c"]
LINK_FLAGS = ["-shared", "-fopenmp", "-lm"]


@dataclass
class NativeDecode:
    """The decodes of a micro-batch as the kernel reads them."""

    rows: torch.Tensor  # [b] row of each decode token in the flattened batch
    tables: torch.Tensor  # [b, nblk] int64 cache blocks of each context (padding: block 0, never read)
    lens: torch.Tensor  # [b] int64 context length of each decode, its own new token included
    block_size: int
    max_len: int  # the longest of `lens` (sizes the kernel's score buffer)
    all_rows: bool = False  # the decodes are every row of the batch, in order (no gather or scatter needed)


def enabled() -> bool:
    return native_build.switched_on(ENV_SWITCH)


KV_DTYPES = (torch.float32, torch.bfloat16)


def usable_for(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether a stage with this KV dtype and device takes the kernel (building it now if needed)."""
    return dtype in KV_DTYPES and torch.device(device).type == "cpu" and _library() is not None


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    d: NativeDecode,
    scale: float,
    lse: torch.Tensor | None = None,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """`q` [b, H, D] (the decode rows, rotary applied); caches [slots, KVH, D], both float32 or both bfloat16.
    Returns [b, H, D] in `q`'s dtype. The kernel works in float32: a bfloat16 `q` is widened (a few KiB per
    layer) and the result rounded back to bfloat16. `lse`, a contiguous float32 `[b, H]`, receives each row's
    log-sum-exp of its scaled scores (what context parallelism merges partial attentions by). `window` > 0: each
    row attends to its last `window` positions (a sliding layer); `softcap` > 0: scores soft-capped (Gemma 2)."""
    lib = _library()
    assert lib is not None, "paged_decode called although usable_for() said no"
    if k_cache.dtype not in KV_DTYPES or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"paged_decode takes float32 or bfloat16 caches, not {k_cache.dtype}/{v_cache.dtype}")
    qf = q.to(torch.float32).contiguous()  # the decode rows, gathered: float32 ones are not copied again
    b, heads, dim = qf.shape
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and d.tables.is_contiguous()):
        raise ValueError("paged_decode needs contiguous caches and block tables")
    out = torch.empty_like(qf)
    args = (
        qf.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        d.tables.data_ptr(),
        d.lens.data_ptr(),
        b,
        heads,
        k_cache.shape[1],
        dim,
        d.block_size,
        d.tables.shape[1],
        d.max_len,
        scale,
        out.data_ptr(),
        torch.get_num_threads(),
        int(k_cache.dtype == torch.bfloat16),
        None if lse is None else lse.data_ptr(),
    )
    rc = lib.paged_decode_window(*args, window, softcap) if window or softcap else lib.paged_decode(*args)
    if rc != 0:
        raise MemoryError("paged_decode: a worker thread could not allocate its score buffer")
    return out.to(q.dtype)


def _library() -> ctypes.CDLL | None:
    """The loaded kernel, or None (disabled, no compiler, build failed): decided once per process."""
    return LIBRARY.get()


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.paged_decode.argtypes = [ptr] * 5 + [i64] * 7 + [ctypes.c_float, ptr, i64, i64, ptr]
    lib.paged_decode.restype = ctypes.c_int
    lib.paged_decode_window.argtypes = lib.paged_decode.argtypes + [i64, ctypes.c_float]
    lib.paged_decode_window.restype = ctypes.c_int
    logger.info("decode attention: native CPU kernel %s", Path(lib._name).name)
    return lib


LIBRARY = native_build.NativeLibrary(
    SOURCE, COMPILE_FLAGS, LINK_FLAGS, logger, "decode attention", "using the torch path", _declare, ENV_SWITCH
)


def _build() -> Path:
    return native_build.build(SOURCE, COMPILE_FLAGS, LINK_FLAGS)
