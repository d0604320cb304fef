"""A decoder layer's elementwise work in one native call each (`layer_ops.c`), for CPU steps of up to
`MAX_ROWS` rows: the residual add with RMSNorm, rotary embedding with the KV cache writes, SiLU times up.

Why: at one decode row a layer's ~100 PyTorch operator calls (a few microseconds of dispatch each) cost more
than their arithmetic; profiled on SmolLM2 at one request they were a third of a step. The results are torch's
bit for bit but for RMSNorm's sum of squares (summed in another order). Larger steps keep torch's operators,
which vectorise better over many rows. Off the CPU, without a compiler, or with `RINGSCHED_NATIVE_LINEAR=0`
(the switch the linear kernel uses), the torch path runs.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

from ringsched.kernels import native_build, small_linear

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("layer_ops.c")
# No -ffast-math and no FMA contraction: the same roundings as torch's operators.
COMPILE_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fPIC", "-c"]
LINK_FLAGS = ["-shared", "-lm"]
MAX_ROWS = 32  # steps of more rows keep torch's operators

_DTYPES = (torch.float32, torch.bfloat16)


def library() -> ctypes.CDLL | None:
    return LIBRARY.get()


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    lib.add_rmsnorm.argtypes = [ptr, ptr, ptr, ptr, i64, i64, f32, i64, i64]
    lib.rope_store.argtypes = [ptr, i64, i64, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr, ptr, i64, i64]
    lib.silu_mul.argtypes = [ptr, i64, ptr, i64, i64, i64]
    for f in (lib.add_rmsnorm, lib.rope_store, lib.silu_mul):
        f.restype = None
    return lib


# Switched by RINGSCHED_NATIVE_LINEAR with the linear kernel: the two are one path.
LIBRARY = native_build.NativeLibrary(
    SOURCE, COMPILE_FLAGS, LINK_FLAGS, logger, "layer ops", "using torch's operators", _declare, small_linear.ENV_SWITCH
)


def usable(dtype: torch.dtype, device: torch.device) -> bool:
    return device.type == "cpu" and dtype in _DTYPES and library() is not None


def add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`RMSNorm.add_forward`: `residual += x` (the first layer starts the residual as `x`), then the norm, written
    into `x` (dead after the add) or, for the first layer, a new tensor. `x`, `residual`: contiguous [T, n]."""
    rows, n = x.shape
    first = residual is None
    out = torch.empty_like(x) if first else x
    res = x if first else residual
    library().add_rmsnorm(
        x.data_ptr(),
        res.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        rows,
        n,
        eps,
        int(first),
        int(x.dtype == torch.bfloat16),
    )
    return out, res


def rope_store(
    qkv: torch.Tensor,
    heads: int,
    kv_heads: int,
    head_dim: int,
    positions: torch.Tensor,
    tables: tuple[torch.Tensor, torch.Tensor],
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """From the fused projection `qkv` [T, (H + 2 KVH) D] (unit stride along a row): returns q [T, H, D] with
    rotary applied, and writes k (rotated) and v into the caches at `slots`. `tables`: float32 cos and sin
    [positions, D] covering every position."""
    rows = qkv.shape[0]
    q = qkv.new_empty(rows, heads, head_dim)
    cos, sin = tables
    library().rope_store(
        qkv.data_ptr(),
        qkv.stride(0),
        rows,
        heads,
        kv_heads,
        head_dim,
        positions.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        slots.data_ptr(),
        int(qkv.dtype == torch.bfloat16),
        int(k_cache.dtype == torch.bfloat16),
    )
    return q


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2n] (unit stride along a row) -> [T, n] `silu(gate) * up`."""
    rows, two_n = gate_up.shape
    out = gate_up.new_empty(rows, two_n // 2)
    library().silu_mul(
        gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), rows, two_n // 2, int(gate_up.dtype == torch.bfloat16)
    )
    return out
