"""The Triton kernels behind `kernels/triton_attention.py` (which launches them). Importing this module imports
Triton, so only `triton_attention` imports it, and only when a kernel first runs.

Every kernel reads the KV pool in place: caches `[num_slots, KVH, D]` (`kv/cache.KVPool`), a sequence's key at
position `p` in slot `table[p // PAGE] * PAGE + p % PAGE`, so any block size works and nothing is gathered.
Scores and sums are float32 whatever the cache dtype; softmax runs in base 2 (`exp2` with the scale times
log2(e) folded into the scores) and LSEs are converted back to natural logs when stored.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LN2 = tl.constexpr(0.6931471805599453)  # globals a kernel reads must be constexpr
# The running maximum starts finite: a row that sees no key in a tile then gets weight exp2(-inf - -1e30) = 0
# instead of exp2(-inf - -inf) = NaN.
NEG_START = tl.constexpr(-1.0e30)
# Triton's interpreter (3.9) multiplies 16-bit float tl.dot operands as their raw integer bits (numpy has no
# bfloat16; its create_dot passes the uint16 storage to np.matmul). Interpreted, the kernels widen the operands
# to float32 first: exact for bfloat16 and float16, and with the probabilities rounded to the cache dtype first,
# the same products the GPU's 16-bit dot takes.
WIDEN = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


@triton.jit
def _attend_tile(q, m, l_sum, acc, K, V, slot, kv_head, offs_d, visible, qk_scale,
                 stride_ks, stride_kh, stride_vs, stride_vh, load_mask, PRECISION: tl.constexpr):  # fmt: skip
    """One tile of keys folded into the online softmax of the rows of `q` ([M, BD]); `visible` [M, N]."""
    k = tl.load(K + slot[:, None] * stride_ks + kv_head * stride_kh + offs_d[None, :], mask=load_mask, other=0.0)
    if WIDEN:
        q, k = q.to(tl.float32), k.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [M, N], log2 domain
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    v = tl.load(V + slot[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :], mask=load_mask, other=0.0)
    p_v = p.to(v.dtype)  # the probabilities in the cache dtype: a 16-bit dot on the GPU
    if WIDEN:
        p_v, v = p_v.to(tl.float32), v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p_v, v, input_precision=PRECISION)
    return m_new, l_sum * alpha + tl.sum(p, 1), acc


@triton.jit
def _slots(Tables, table_row, pos, valid, PAGE: tl.constexpr):
    """Cache slot of each key position (`valid` False: slot 0, never loaded)."""
    block = tl.load(Tables + table_row + pos // PAGE, mask=valid, other=0).to(tl.int64)
    return block * PAGE + pos % PAGE


@triton.jit
def decode_split_kernel(
    Q, K, V, Tables, Lens, MidO, MidLse, qk_scale,
    stride_qb, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_tb,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Program (sequence, KV head, split): the GROUP query heads sharing the KV head (padded to BLOCK_H rows, so
    tl.dot gets at least 16) over the split's share of the context, each split `ceil(len / splits)` keys rounded
    up to whole tiles. Writes the split's normalised output and LSE; a split past the context writes 0 and -inf."""
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    length = tl.load(Lens + seq)
    per_split = tl.cdiv(tl.cdiv(length, tl.num_programs(2)), BLOCK_N) * BLOCK_N
    lo = split * per_split
    hi = tl.minimum(lo + per_split, length)
    offs_h, offs_d = tl.arange(0, BLOCK_H), tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_h
    head_ok, d_ok = offs_h < GROUP, offs_d < D
    q = tl.load(Q + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=head_ok[:, None] & d_ok[None, :], other=0.0)  # fmt: skip
    m = tl.full([BLOCK_H], NEG_START, tl.float32)
    l_sum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        valid = pos < hi
        slot = _slots(Tables, seq * stride_tb, pos, valid, PAGE)
        m, l_sum, acc = _attend_tile(q, m, l_sum, acc, K, V, slot, kv_head, offs_d, valid[None, :], qk_scale,
                                     stride_ks, stride_kh, stride_vs, stride_vh, valid[:, None] & d_ok[None, :],
                                     PRECISION)  # fmt: skip
    seen = l_sum > 0
    out = acc / tl.where(seen, l_sum, 1.0)[:, None]
    lse = tl.where(seen, (m + tl.log2(tl.where(seen, l_sum, 1.0))) * LN2, float("-inf"))
    o_ptr = MidO + seq * stride_ob + heads[:, None] * stride_oh + split * stride_os + offs_d[None, :]
    tl.store(o_ptr, out, mask=head_ok[:, None] & d_ok[None, :])
    tl.store(MidLse + seq * stride_lb + heads * stride_lh + split, lse, mask=head_ok)


@triton.jit
def merge_kernel(
    MidO, MidLse, Out, Lse, num_parts,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_outb, stride_outh, stride_lse,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    """Program (row, head): the row's partial outputs over disjoint keys as one, weights e^(LSE_i - LSE) with
    LSE = logsumexp_i LSE_i (`models/ring_attention.merge_all`'s arithmetic); a row no part saw stays 0, -inf."""
    row, head = tl.program_id(0), tl.program_id(1)
    offs_s, offs_d = tl.arange(0, BLOCK_S), tl.arange(0, BLOCK_D)
    s_ok, d_ok = offs_s < num_parts, offs_d < D
    lse = tl.load(MidLse + row * stride_lb + head * stride_lh + offs_s, mask=s_ok, other=float("-inf"))
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)
    w = tl.exp(lse - top)  # 0 for a part that saw nothing
    o = tl.load(MidO + row * stride_ob + head * stride_oh + offs_s[:, None] * stride_os + offs_d[None, :],
                mask=s_ok[:, None] & d_ok[None, :], other=0.0)  # fmt: skip
    total = tl.sum(w, 0)
    out = tl.sum(w[:, None] * o, 0) / tl.where(total > 0, total, 1.0)
    tl.store(Out + row * stride_outb + head * stride_outh + offs_d, out.to(Out.dtype.element_ty), mask=d_ok)
    lse_out = tl.where(total > 0, top + tl.log(tl.where(total > 0, total, 1.0)), float("-inf"))
    tl.store(Lse + row * stride_lse + head, lse_out)


@triton.jit
def extend_kernel(
    Q, K, V, Out, Tables, KvLens, QStarts, QLens, Positions, qk_scale,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_tb, stride_ot, stride_oh,
    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Program (sequence, query head, tile of BLOCK_M new tokens): the tokens attend to the sequence's keys at
    positions up to and including their own (`Positions` of their rows): its cached prefix and the new tokens,
    all read from the pool (the new K/V are written there first). Tiles past the last key any of them sees are
    not read."""
    seq, head, tile = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_len = tl.load(QLens + seq)
    if tile * BLOCK_M >= q_len:
        return
    q_start, kv_len = tl.load(QStarts + seq), tl.load(KvLens + seq)
    offs_m, offs_d = tile * BLOCK_M + tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_D)
    m_ok, d_ok = offs_m < q_len, offs_d < D
    rows = (q_start + offs_m).to(tl.int64)
    q_pos = tl.load(Positions + rows, mask=m_ok, other=-1)
    q = tl.load(Q + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=m_ok[:, None] & d_ok[None, :], other=0.0)  # fmt: skip
    kv_head = head // GROUP
    hi = tl.minimum(kv_len, tl.max(q_pos, 0) + 1)
    m = tl.full([BLOCK_M], NEG_START, tl.float32)
    l_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(0, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        valid = pos < hi
        slot = _slots(Tables, seq * stride_tb, pos, valid, PAGE)
        visible = valid[None, :] & (pos[None, :] <= q_pos[:, None])
        m, l_sum, acc = _attend_tile(q, m, l_sum, acc, K, V, slot, kv_head, offs_d, visible, qk_scale,
                                     stride_ks, stride_kh, stride_vs, stride_vh, valid[:, None] & d_ok[None, :],
                                     PRECISION)  # fmt: skip
    out = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
    tl.store(Out + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :], out.to(Out.dtype.element_ty),
             mask=m_ok[:, None] & d_ok[None, :])  # fmt: skip
