"""Attention over a paged KV cache, and the batch description every layer reads.

A micro-batch is flattened to `T` tokens. Each sequence in it is either a decode (one new token) or a
prefill chunk (`n` new tokens after `kv_len - n` cached ones). New K/V are written to the cache at
`slot_mapping`; attention then reads only each sequence's own slots (never the whole cache).

Without a cache (`ForwardBatch.no_cache`) the batch is one sequence attending causally to itself: the
reference path tests compare against.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ringsched.attention.window import WindowedAttention
from ringsched.kernels import native
from ringsched.kernels.native import NativeDecode


@dataclass
class PrefillSeq:
    row: int  # first row of this chunk in the flattened batch
    num_new: int  # tokens in this chunk
    ctx_slots: torch.Tensor  # [kv_len] cache slots of the whole context, this chunk included


@dataclass
class DecodeGroup:
    """Decodes of similar context length, padded to the longest of them."""

    rows: torch.Tensor  # [b] row of each decode token
    blocks: torch.Tensor  # [b * nblk] cache blocks of each context, row-major; padding points at a valid block
    mask: torch.Tensor  # [b, 1, 1, Lmax] True where a position is real (Lmax = nblk * block size)
    max_len: int


@dataclass
class PagedSeqs:
    """Sequences as the Triton kernels read them (`kernels/triton_attention.py`), the pool read in place: `rows`
    their new tokens' rows (decodes: one each), `tables` `[S, max_blocks]` int32 their blocks in position order,
    `kv_lens` `[S]` int32 their context lengths (new tokens included); on the batch's device."""

    rows: torch.Tensor  # [S] int64: decodes, the row of each token; extends, the first row of each chunk
    tables: torch.Tensor
    kv_lens: torch.Tensor
    max_kv_len: int
    q_lens: torch.Tensor | None = None  # extends: [S] int32 tokens in each chunk
    max_q_len: int = 1
    all_rows: bool = False  # decodes: every row of the batch, in order (no gather or scatter)


@dataclass
class ForwardBatch:
    positions: torch.Tensor  # [T] absolute position of each token
    logit_rows: torch.Tensor  # [S] row whose logits are sampled, one per sequence that samples
    slot_mapping: torch.Tensor | None = None  # [T] cache slot each new token's K/V goes to
    position_bound: int | None = None  # the largest of `positions`, from the plan (None: read from the device)
    samples_all: bool = False  # every row samples, in order (`logit_rows` is 0..T-1): a decode-only step
    decodes: list[DecodeGroup] = field(default_factory=list)
    native_decode: NativeDecode | None = None  # the decodes, for the CPU kernel (then `decodes` is empty)
    prefills: list[PrefillSeq] = field(default_factory=list)
    # The Triton backend's description of the decodes and the prefill chunks (`attention/backend.py`)
    paged_decodes: PagedSeqs | None = None
    paged_extends: PagedSeqs | None = None
    block_size: int = 0
    # How the batch attends once its new K/V are in the cache: `(q, batch, k_cache, v_cache, scale) -> [T, H, D]`.
    # The stage's `attention_backend.AttentionBackend` sets it when it builds the batch, so the choice of backend
    # is made once per stage, never per call.
    attend: Callable[..., torch.Tensor] = field(default_factory=lambda: gathered_attention, repr=False)
    # The last stage's sampling rows `[S, hidden]` of the whole micro-batch from this rank's: the same rows, but under
    # context parallelism, where each rank holds some of them (`attention/cp_backend.py`)
    gather_samples: Callable[[torch.Tensor], torch.Tensor] = field(default_factory=lambda: _same, repr=False)
    # Every sequence as `(first row, new tokens, context length, the context's cache slots)`, built on first call
    # (`batch._flatten`): what a sliding or soft-capped layer attends over (`attention/window.py`).
    contexts: Callable[[], list[tuple[int, int, int, torch.Tensor]]] = field(
        default_factory=lambda: lambda: [], repr=False
    )
    # A model with sliding layers: the same batch as those layers' caches address it (`kv/ring.py`): its own new
    # tokens' slots, contexts (each the slots of its window's positions at least, ending at the context's last)
    # and CPU-kernel decodes; None otherwise (every layer reads this batch)
    sliding: ForwardBatch | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    @property
    def uses_cache(self) -> bool:
        return self.slot_mapping is not None

    @classmethod
    def no_cache(cls, num_tokens: int, device: torch.device | str = "cpu") -> ForwardBatch:
        """One sequence of `num_tokens` attending causally to itself; logits for every row."""
        rows = torch.arange(num_tokens, device=device)
        return cls(positions=rows, logit_rows=rows)


def paged_attention(
    q: torch.Tensor,  # [T, H, D], rotary applied
    k: torch.Tensor | None,  # [T, KVH, D]; None: already in the cache (`layer_ops.rope_store`)
    v: torch.Tensor | None,  # [T, KVH, D]
    batch: ForwardBatch,
    k_cache: torch.Tensor | None,  # [num_slots, KVH, D]
    v_cache: torch.Tensor | None,
    scale: float,
    attend: WindowedAttention | None = None,  # a sliding or soft-capped layer's, in place of the backend's
) -> torch.Tensor:
    """Returns `[T, H, D]`."""
    if not batch.uses_cache:
        return attend.without_cache(q, k, v, scale) if attend is not None else _sdpa(q, k, v, scale, causal=True)
    assert k_cache is not None and v_cache is not None
    if k is not None:
        k_cache.index_copy_(0, batch.slot_mapping, k)
        v_cache.index_copy_(0, batch.slot_mapping, v)
    return (attend or batch.attend)(q, batch, k_cache, v_cache, scale)


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def gathered_attention(q, batch: ForwardBatch, k_cache, v_cache, scale: float) -> torch.Tensor:
    """The torch and native backends: decodes through the CPU kernel (`native_decode`) or gathered in length
    groups, prefill chunks gathered and attended by SDPA."""
    nd = batch.native_decode
    if nd is not None and nd.all_rows:  # every row a decode, in order
        return native.paged_decode(q, k_cache, v_cache, nd, scale)
    out = torch.empty_like(q)
    for g in batch.decodes:
        out.index_copy_(0, g.rows, _decode(q, k_cache, v_cache, g, scale))
    if nd is not None:
        out.index_copy_(0, nd.rows, native.paged_decode(q.index_select(0, nd.rows), k_cache, v_cache, nd, scale))
    for p in batch.prefills:
        rows = slice(p.row, p.row + p.num_new)
        kp, vp = k_cache.index_select(0, p.ctx_slots), v_cache.index_select(0, p.ctx_slots)
        out[rows] = _sdpa(q[rows], kp, vp, scale, causal=True)
    return out


def _decode(q, k_cache, v_cache, g: DecodeGroup, scale: float) -> torch.Tensor:
    # Gather whole blocks (one contiguous block_size * KVH * D run each): b * nblk indices, not b * Lmax.
    b, kvh, d = g.rows.shape[0], k_cache.shape[1], k_cache.shape[2]
    block = g.max_len // (g.blocks.shape[0] // b) * kvh * d  # elements per block: block_size * KVH * D
    kd = k_cache.view(-1, block).index_select(0, g.blocks).view(b, g.max_len, kvh, d).transpose(1, 2)
    vd = v_cache.view(-1, block).index_select(0, g.blocks).view(b, g.max_len, kvh, d).transpose(1, 2)
    # Grouped-query attention folded into the query length: the H / KVH query heads sharing a KV head attend
    # as that head's queries, so K/V are never repeated per query head ([b, KVH, H / KVH, D]).
    h = q.shape[1]
    qd = q.index_select(0, g.rows).view(b, kvh, h // kvh, d)
    out = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=g.mask, scale=scale)
    return out.reshape(b, h, d)


def _sdpa(q, k, v, scale: float, causal: bool) -> torch.Tensor:
    """Causal attention of `n` queries that are the last `n` of `kv_len` keys. Shapes `[n|kv_len, h, D]`.

    The inputs go in as 4-D `[1, h, n, D]`: torch's CPU flash-attention kernel takes only 4-D inputs, and 3-D
    ones fall back to the math path, which materialises the `[h, n, kv_len]` scores (measured for a 512-token
    SmolLM2 prefill: 20.3 ms and 9 MiB of scores per layer, against 7.6 ms with flash)."""
    n, kv_len = q.shape[0], k.shape[0]
    qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    gqa = qt.shape[1] != kt.shape[1]
    if n == kv_len:
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, scale=scale, enable_gqa=gqa)
    else:
        # Query i sits at position kv_len - n + i and sees keys up to and including it.
        qpos = torch.arange(kv_len - n, kv_len, device=q.device).unsqueeze(1)
        mask = torch.arange(kv_len, device=q.device).unsqueeze(0) <= qpos
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out.squeeze(0).transpose(0, 1)
