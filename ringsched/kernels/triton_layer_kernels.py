"""The Triton kernels behind `kernels/triton_layer_ops.py` (which launches them): a decoder layer's elementwise
work, one launch each. Importing this module imports Triton, so only `triton_layer_ops` imports it, on first use.

Arithmetic is float32 whatever the tensors' dtype, rounded to it where torch's operators round (the residual sum,
the normalised row before the weight, the rotated heads), so float32 results are torch's up to the order of
the sum of squares.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def add_rmsnorm_kernel(X, Res, W, Out, stride_x, stride_r, stride_o, n, eps, FIRST: tl.constexpr, BLOCK: tl.constexpr):
    """Program `row`: `Res[row] += X[row]` (FIRST: the residual is X itself, left as it is), then
    `Out[row] = rmsnorm(Res[row]) * W`."""
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    ok = offs < n
    x = tl.load(X + row * stride_x + offs, mask=ok, other=0.0)
    if FIRST:
        s = x
    else:
        s = (tl.load(Res + row * stride_r + offs, mask=ok, other=0.0).to(tl.float32) + x.to(tl.float32)).to(x.dtype)
        tl.store(Res + row * stride_r + offs, s, mask=ok)
    sf = s.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(sf * sf, 0) / n + eps)
    y = (sf * inv).to(x.dtype).to(tl.float32)
    w = tl.load(W + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(Out + row * stride_o + offs, (y * w).to(x.dtype), mask=ok)


@triton.jit
def _rotate_heads(Src, Dst, first_head, heads, cos1, sin1, offs_h, offs_d, dst_stride_h, HALF: tl.constexpr):
    """Heads `first_head ..` of a row of the fused projection (`Src` at its start), rotate-half rotated with the
    row's `cos1`/`sin1` (the first half of the table row; the second is the same), into `Dst` `[heads, D]`."""
    ok = (offs_h < heads)[:, None] & (offs_d < HALF)[None, :]
    at = (first_head + offs_h)[:, None] * (2 * HALF) + offs_d[None, :]
    x1 = tl.load(Src + at, mask=ok, other=0.0)
    x2 = tl.load(Src + at + HALF, mask=ok, other=0.0).to(tl.float32)
    x1f = x1.to(tl.float32)
    out = offs_h[:, None] * dst_stride_h + offs_d[None, :]
    tl.store(Dst + out, (x1f * cos1 - x2 * sin1).to(x1.dtype), mask=ok)
    tl.store(Dst + out + HALF, (x2 * cos1 + x1f * sin1).to(x1.dtype), mask=ok)


@triton.jit
def rope_store_kernel(
    QKV,
    Pos,
    Cos,
    Sin,
    Q,
    KC,
    VC,
    Slots,
    stride_qkv,
    stride_q,
    stride_cos,
    stride_ks,
    stride_vs,
    H: tl.constexpr,
    KVH: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """Program `row` of the fused projection `[T, (H + 2 KVH) D]`: q's heads rotated into `Q[row]`, k's rotated and
    v's as they are into the caches `[slots, KVH, D]` at `Slots[row]`."""
    row = tl.program_id(0)
    offs_h, offs_d = tl.arange(0, BLOCK_H), tl.arange(0, BLOCK_HALF)
    pos = tl.load(Pos + row)
    slot = tl.load(Slots + row).to(tl.int64)
    cos1 = tl.load(Cos + pos * stride_cos + offs_d, mask=offs_d < HALF, other=0.0)[None, :]
    sin1 = tl.load(Sin + pos * stride_cos + offs_d, mask=offs_d < HALF, other=0.0)[None, :]
    src = QKV + row * stride_qkv
    _rotate_heads(src, Q + row * stride_q, 0, H, cos1, sin1, offs_h, offs_d, 2 * HALF, HALF)
    _rotate_heads(src, KC + slot * stride_ks, H, KVH, cos1, sin1, offs_h, offs_d, 2 * HALF, HALF)
    ok = (offs_h < KVH)[:, None] & (offs_d < HALF)[None, :]
    at = (H + KVH + offs_h)[:, None] * (2 * HALF) + offs_d[None, :]
    dst = VC + slot * stride_vs + offs_h[:, None] * (2 * HALF) + offs_d[None, :]
    tl.store(dst, tl.load(src + at, mask=ok, other=0.0), mask=ok)
    tl.store(dst + HALF, tl.load(src + at + HALF, mask=ok, other=0.0), mask=ok)


@triton.jit
def silu_mul_kernel(GU, Out, stride_gu, stride_o, n, BLOCK: tl.constexpr):
    """Program (row, block): `Out[row, j] = silu(gate[j]) * up[j]` for the block's `j`, gate and up the two halves
    of `GU[row]`."""
    row, blk = tl.program_id(0), tl.program_id(1)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    g = tl.load(GU + row * stride_gu + offs, mask=ok, other=0.0)
    u = tl.load(GU + row * stride_gu + n + offs, mask=ok, other=0.0).to(tl.float32)
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)
    tl.store(Out + row * stride_o + offs, (act * u).to(g.dtype), mask=ok)
