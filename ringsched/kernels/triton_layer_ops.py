"""A decoder layer's elementwise work as one Triton launch each (`kernels/triton_layer_kernels.py`): the residual
add with RMSNorm, rotary embedding with the KV cache writes, SiLU times up. The same three calls, with the same
signatures, as the CPU's native `layer_ops`: a layer runs `DecoderLayer._small_step` with either
(`models/decoder_layer.py`).

Why: on a GPU each torch operator is a kernel launch, and a layer's elementwise stages are most of its launches
(RMSNorm alone nine, rotary ten); these three take a decode layer from about 38 launches to 11 (`python -m
ringsched.bench overhead --ops`). Used on CUDA for steps of any size; on CPU the same kernels run under Triton's
interpreter (slow: tests and the op counter).
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from types import ModuleType

import torch

MAX_ROWS = sys.maxsize  # every step takes them: a GPU's launches cost the same whatever the rows
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.cache
def _kernels() -> ModuleType:
    from ringsched.kernels import triton_layer_kernels

    return triton_layer_kernels


def usable(dtype: torch.dtype, device: torch.device) -> bool:
    return device.type == "cuda" and dtype in _DTYPES and importlib.util.find_spec("triton") is not None


def _block(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`RMSNorm.add_forward`: `residual += x` (the first layer starts the residual as `x`), then the norm, written
    into `x` (dead after the add) or, for the first layer, a new tensor. `x`, `residual`: [T, n], unit stride
    along a row."""
    rows, n = x.shape
    first = residual is None
    out = torch.empty_like(x) if first else x
    res = x if first else residual
    if rows:
        _kernels().add_rmsnorm_kernel[(rows,)](
            x, res, weight, out, x.stride(0), res.stride(0), out.stride(0), n, eps, FIRST=first, BLOCK=_block(n)
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
    rotary applied, and writes k (rotated) and v into the caches `[slots, KVH, D]` (contiguous) at `slots`.
    `tables`: float32 cos and sin [positions, D] covering every position."""
    rows = qkv.shape[0]
    q = qkv.new_empty(rows, heads, head_dim)
    cos, sin = tables
    if rows:
        half = head_dim // 2
        _kernels().rope_store_kernel[(rows,)](
            qkv,
            positions,
            cos,
            sin,
            q,
            k_cache,
            v_cache,
            slots,
            qkv.stride(0),
            q.stride(0),
            cos.stride(0),
            k_cache.stride(0),
            v_cache.stride(0),
            H=heads,
            KVH=kv_heads,
            HALF=half,
            BLOCK_H=_block(max(heads, kv_heads)),
            BLOCK_HALF=_block(half),
        )
    return q


SILU_BLOCK = 1024  # columns per program


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2n] (unit stride along a row) -> [T, n] `silu(gate) * up`."""
    rows, two_n = gate_up.shape
    n = two_n // 2
    out = gate_up.new_empty(rows, n)
    if rows:
        block = min(SILU_BLOCK, _block(n))
        _kernels().silu_mul_kernel[(rows, -(-n // block))](
            gate_up, out, gate_up.stride(0), out.stride(0), n, BLOCK=block
        )
    return out
