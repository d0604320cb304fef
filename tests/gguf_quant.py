"""GGUF quantization of float weights for tests, in ggml's own block layouts: Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 by the
`gguf` package (`gguf.quants.quantize`), Q4_K, Q5_K and Q6_K by the small numpy quantizers here (the package can
only dequantize the K-quants). Not llama.cpp's error-minimising search: per sub-block min/max (Q4_K, Q5_K) or
absmax (Q6_K) scales, each 6- or 8-bit scale rounded up so no value clips; `gguf.quants.dequantize` of the result
is within about half a quantization step of the input."""

from __future__ import annotations

import gguf
import numpy as np

QK_K = 256


def quantize(w: np.ndarray, type_name: str) -> np.ndarray:
    """`w` [..., k] float32 -> [..., row_bytes] uint8, each row `type_name`'s blocks (k a whole number of them)."""
    qtype = gguf.GGMLQuantizationType[type_name]
    w = np.ascontiguousarray(w, dtype=np.float32)
    values, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    if w.shape[-1] % values:
        raise ValueError(f"{type_name}: rows of {w.shape[-1]} values are not whole blocks of {values}")
    if type_name in K_QUANTS:
        blocks = K_QUANTS[type_name](w.reshape(-1, QK_K))
        return blocks.reshape(*w.shape[:-1], w.shape[-1] // values * nbytes)
    return gguf.quants.quantize(w, qtype)


def _f16_up(v: np.ndarray) -> np.ndarray:
    """`v` (>= 0) as float16, rounded up: a super-block scale that divides its largest sub-block scale into no more
    than the top code."""
    h = v.astype(np.float16)
    low = h.astype(np.float32) < v
    h[low] = np.nextafter(h[low], np.float16(np.inf))
    return h


def _min_max_k(x: np.ndarray, top: int) -> tuple[np.ndarray, ...]:
    """Q4_K / Q5_K (`top` 15 / 31): `x` [n, 256] -> (d, dmin float16 [n], scales, mins uint8 [n, 8] of 6 bits,
    codes uint8 [n, 8, 32]) with value = d * scale * code - dmin * min."""
    x = x.reshape(-1, 8, 32)
    lo = -np.minimum(x.min(-1), 0)  # ggml's minimum is never above 0: value = d*sc*q - dmin*m with m >= 0
    dmin = _f16_up(lo.max(-1) / 63)
    dmin32 = dmin.astype(np.float32)[:, None]
    mins = np.clip(np.ceil(np.divide(lo, dmin32, out=np.zeros_like(lo), where=dmin32 > 0)), 0, 63)
    off = dmin32 * mins  # at or below each sub-block's minimum
    step = (x.max(-1) + off) / top
    d = _f16_up(step.max(-1) / 63)
    d32 = d.astype(np.float32)[:, None]
    scales = np.clip(np.ceil(np.divide(step, d32, out=np.zeros_like(step), where=d32 > 0)), 0, 63)
    unit = (d32 * scales)[..., None]
    codes = np.divide(x + off[..., None], unit, out=np.zeros_like(x), where=unit > 0)
    codes = np.clip(np.round(codes), 0, top).astype(np.uint8)
    return d, dmin, scales.astype(np.uint8), mins.astype(np.uint8), codes


def _pack_scales(scales: np.ndarray, mins: np.ndarray) -> np.ndarray:
    """ggml's 12 bytes of eight 6-bit scales and mins (`get_scale_min_k4`): sub-blocks 0-3 in the low 6 bits of bytes
    0-3 (scales) and 4-7 (mins); sub-blocks 4-7 in the low (scale) and high (min) nibbles of bytes 8-11, their top two
    bits in the top two bits of bytes 0-3 (scales) and 4-7 (mins)."""
    sc_lo, sc_hi, m_lo, m_hi = scales[:, :4], scales[:, 4:], mins[:, :4], mins[:, 4:]
    return np.concatenate(
        [sc_lo | ((sc_hi >> 4) << 6), m_lo | ((m_hi >> 4) << 6), (sc_hi & 0xF) | ((m_hi & 0xF) << 4)], axis=1
    ).astype(np.uint8)


def _nibbles(codes: np.ndarray) -> np.ndarray:
    """[n, 8, 32] codes -> [n, 128]: byte 32c + l holds sub-block 2c's value l (low nibble) and 2c+1's (high)."""
    pairs = codes.reshape(-1, 4, 2, 32) & 0xF
    return (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)


def _halves(h: np.ndarray) -> np.ndarray:
    return h.astype(np.float16).view(np.uint8).reshape(-1, 2)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """[n, 256] -> [n, 144]: fp16 d, fp16 dmin, 12 bytes of scales and mins, 128 bytes of 4-bit codes."""
    d, dmin, scales, mins, codes = _min_max_k(x, 15)
    return np.concatenate([_halves(d), _halves(dmin), _pack_scales(scales, mins), _nibbles(codes)], axis=1)


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    """[n, 256] -> [n, 176]: as Q4_K with 32 bytes of fifth bits before the codes (bit c of byte l: sub-block c's
    value l)."""
    d, dmin, scales, mins, codes = _min_max_k(x, 31)
    high = ((codes >> 4) & 1) << np.arange(8, dtype=np.uint8)[None, :, None]
    qh = np.bitwise_or.reduce(high, axis=1).astype(np.uint8)
    return np.concatenate([_halves(d), _halves(dmin), _pack_scales(scales, mins), qh, _nibbles(codes)], axis=1)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """[n, 256] -> [n, 210]: ql[128], qh[64], int8 scales[16] (one per 16 values), fp16 d. Value 128h + 32c + l's
    6-bit code (q + 32) keeps its low 4 bits in ql[64h + 32(c % 2) + l] (low nibble for c < 2, high for c >= 2) and
    its top 2 in bits 2c, 2c+1 of qh[32h + l]; value = d * scale * q."""
    n = x.shape[0]
    x = x.reshape(n, 16, 16)
    step = np.abs(x).max(-1) / 31  # codes -31..31 of the -32..31 ggml stores
    d = _f16_up(step.max(-1) / 127)
    d32 = d.astype(np.float32)[:, None]
    scales = np.clip(np.ceil(np.divide(step, d32, out=np.zeros_like(step), where=d32 > 0)), 0, 127)
    unit = (d32 * scales)[..., None]
    q = np.clip(np.round(np.divide(x, unit, out=np.zeros_like(x), where=unit > 0)), -32, 31)
    u = (q + 32).astype(np.uint8).reshape(n, 2, 4, 32)  # [n, h, c, l]
    ql = (u[:, :, :2] & 0xF) | ((u[:, :, 2:] & 0xF) << 4)  # [n, h, c % 2, l]
    qh = np.bitwise_or.reduce((u >> 4) << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None], axis=2)
    return np.concatenate(
        [ql.reshape(n, 128), qh.astype(np.uint8).reshape(n, 64), scales.astype(np.int8).view(np.uint8),
         _halves(d)], axis=1)  # fmt: skip


K_QUANTS = {"Q4_K": quantize_q4_k, "Q5_K": quantize_q5_k, "Q6_K": quantize_q6_k}
