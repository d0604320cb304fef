"""Attention over the paged KV pool with Triton kernels (`kernels/triton_kernels.py`): the GPU path, and on CPU
the same kernels under Triton's interpreter (slow; for tests).

- **decode** (`paged_decode`): one query token per sequence over its whole context, split-K: each split of the
  context gives a normalised partial output and its log-sum-exp (`decode_partials`), and `merge_partials` folds
  them into one. Context parallelism can merge partials from several ranks with the same `merge_partials`.
- **extend** (`paged_extend`): a sequence's new tokens (a prefill chunk, after a cached prefix or earlier
  chunks) over its cached keys and themselves, causal by the rows' positions.

Layouts, as `kv/cache.KVPool` and `models/attention.ForwardBatch` hold them:
  q `[T, H, D]` (rotary applied), H a multiple of KVH; caches `[num_slots, KVH, D]`, float32, bfloat16 or
  float16, the same dtype as q, the new tokens' K/V already written; block tables `[S, max_blocks]` int32 (a
  sequence's blocks in position order: position p is in slot `table[p // block_size] * block_size +
  p % block_size`; entries past its length are not read); lengths and row offsets `[S]` int32; positions `[T]`
  int64. Outputs are in q's dtype; LSEs float32 natural logs (-inf for a split that saw no key).

Triton is imported when a kernel first runs (`_kernels`), so this module imports without it. On CPU
`TRITON_INTERPRET` must be set before that import (`attention/backend.py` does it).
"""

from __future__ import annotations

import functools
import math
from types import ModuleType

import torch

DECODE_TILE = 64  # keys per step of a decode split
EXTEND_TILE_N = 64  # keys per step of an extend tile
SPLIT_MIN_KEYS = 256  # a decode split covers at least this many keys (fewer: the merge costs more than it saves)
MAX_SPLITS = 16


@functools.cache
def _kernels() -> ModuleType:
    from ringsched.kernels import triton_kernels

    return triton_kernels


def _precision(dtype: torch.dtype) -> str:
    # float32 products in full precision: TF32 would cost ~1e-3 relative error against the other backends.
    return "ieee" if dtype == torch.float32 else "tf32"


def _block_d(dim: int) -> int:
    return max(16, 1 << (dim - 1).bit_length())  # a power of two, >= tl.dot's minimum of 16


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int]:
    heads, dim = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[1]
    if heads % kv_heads or k_cache.shape != v_cache.shape or k_cache.shape[2] != dim:
        raise ValueError(f"triton attention: q {tuple(q.shape)} does not fit caches {tuple(k_cache.shape)} / "
                         f"{tuple(v_cache.shape)} (heads a multiple of KV heads, the same head dim)")  # fmt: skip
    if q.dtype != k_cache.dtype or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"triton attention: q, K and V caches must share a dtype, not {q.dtype}/{k_cache.dtype}/"
                         f"{v_cache.dtype}")  # fmt: skip
    if k_cache.stride(2) != 1 or v_cache.stride(2) != 1 or q.stride(2) != 1:
        raise ValueError("triton attention: the head dimension of q and the caches must be contiguous")
    return heads, kv_heads, dim


def num_splits(max_len: int) -> int:
    """How many splits a decode of contexts up to `max_len` keys uses: one per SPLIT_MIN_KEYS, at most
    MAX_SPLITS (more splits, more programs in flight for a few long sequences)."""
    return max(1, min(MAX_SPLITS, max_len // SPLIT_MIN_KEYS))


def decode_partials(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                    lens: torch.Tensor, block_size: int, scale: float, splits: int,
                    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """`q` `[B, H, D]` (one token per sequence) over `lens[i]` keys of sequence i: each of `splits` consecutive
    shares of its context attended alone. Returns outputs `[B, H, splits, D]` and LSEs `[B, H, splits]`, both
    float32 (a split past the context: 0 and -inf)."""
    heads, kv_heads, dim = _check(q, k_cache, v_cache)
    b = q.shape[0]
    mid_o = torch.empty(b, heads, splits, dim, dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(b, heads, splits, dtype=torch.float32, device=q.device)
    if b == 0:
        return mid_o, mid_lse
    group = heads // kv_heads
    _kernels().decode_split_kernel[(b, kv_heads, splits)](
        q, k_cache, v_cache, tables, lens, mid_o, mid_lse, scale * _kernels().LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        tables.stride(0), mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        GROUP=group, D=dim, BLOCK_D=_block_d(dim), BLOCK_H=max(16, 1 << (group - 1).bit_length()),
        BLOCK_N=DECODE_TILE, PAGE=block_size, PRECISION=_precision(q.dtype),
    )  # fmt: skip
    return mid_o, mid_lse


def merge_partials(outs: torch.Tensor, lses: torch.Tensor, dtype: torch.dtype | None = None,
                   ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Partial attentions of the same rows over disjoint keys, `outs` `[B, H, P, D]` with LSEs `[B, H, P]`
    (float32; -inf for a part with no key), as one: `[B, H, D]` in `dtype` (default outs' dtype) and LSE `[B, H]`
    float32. The arithmetic of `models/ring_attention.merge_all`, in one kernel."""
    b, heads, parts, dim = outs.shape
    if outs.stride(3) != 1 or lses.stride(2) != 1:
        raise ValueError("merge_partials: the last dimension of outs and lses must be contiguous")
    out = torch.empty(b, heads, dim, dtype=dtype or outs.dtype, device=outs.device)
    lse = torch.empty(b, heads, dtype=torch.float32, device=outs.device)
    if b == 0:
        return out, lse
    _kernels().merge_kernel[(b, heads)](
        outs, lses, out, lse, parts, outs.stride(0), outs.stride(1), outs.stride(2), lses.stride(0),
        lses.stride(1), out.stride(0), out.stride(1), lse.stride(0),
        D=dim, BLOCK_D=_block_d(dim), BLOCK_S=max(2, 1 << (parts - 1).bit_length()),
    )  # fmt: skip
    return out, lse


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                 lens: torch.Tensor, block_size: int, scale: float, max_len: int | None = None,
                 splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Decode attention: `q` `[B, H, D]` over `lens[i]` keys of sequence i (its new token's included). Returns
    `[B, H, D]` in q's dtype and each row's LSE `[B, H]` float32. `splits` defaults to `num_splits(max_len)`
    (`max_len`: the longest of `lens`, read from the device when not given)."""
    if max_len is None:
        max_len = int(lens.max()) if lens.numel() else 0  # a device-to-host sync: callers pass it when they know it
    splits = num_splits(max_len) if splits is None else splits
    parts = decode_partials(q, k_cache, v_cache, tables, lens, block_size, scale, splits)
    return merge_partials(*parts, dtype=q.dtype)


def paged_extend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                 kv_lens: torch.Tensor, q_starts: torch.Tensor, q_lens: torch.Tensor, positions: torch.Tensor,
                 block_size: int, scale: float, max_q_len: int, out: torch.Tensor | None = None,
                 ) -> torch.Tensor:  # fmt: skip
    """Extend (prefill) attention of S sequences: sequence i's `q_lens[i]` new tokens are rows `q_starts[i]..` of
    `q` `[T, H, D]`; the row at position p sees keys 0..p of the sequence's `kv_lens[i]` (its cached prefix and
    the new tokens, in the pool already). Writes those rows of `out` (`[T, H, D]`, default a new tensor whose
    other rows are left unset) and returns it. `max_q_len`: the longest of `q_lens` (sizes the grid)."""
    heads, kv_heads, dim = _check(q, k_cache, v_cache)
    out = torch.empty_like(q) if out is None else out
    seqs = q_lens.shape[0]
    if seqs == 0 or max_q_len == 0:
        return out
    block_m = 64 if dim <= 64 else 32  # rows per program: fewer with wide heads, to stay within registers
    _kernels().extend_kernel[(seqs, heads, math.ceil(max_q_len / block_m))](
        q, k_cache, v_cache, out, tables, kv_lens, q_starts, q_lens, positions, scale * _kernels().LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        tables.stride(0), out.stride(0), out.stride(1),
        GROUP=heads // kv_heads, D=dim, BLOCK_D=_block_d(dim), BLOCK_M=block_m, BLOCK_N=EXTEND_TILE_N,
        PAGE=block_size, PRECISION=_precision(q.dtype),
    )  # fmt: skip
    return out
