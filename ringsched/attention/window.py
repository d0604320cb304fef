"""Attention of a layer that slides (each query sees its last `window` tokens, itself included) or soft-caps its
scores (`cap * tanh(scores / cap)`, Gemma 2): per sequence, over the part of the paged KV the window reaches, for
every backend's batch (`ForwardBatch.contexts`); the decodes of a CPU batch through the decode kernel, which takes
the window and the cap (`native.paged_decode`). Either way only the window's K/V are read, so a decode of a sliding
layer reads at most `window` tokens however long its context. Soft-capping runs the scores through torch ops (SDPA has
no cap); a plain sliding window runs SDPA with a band mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ringsched.kernels import native


class WindowedAttention:
    """`ForwardBatch.attend`'s signature for a sliding and/or soft-capped layer; `window` 0: no window."""

    def __init__(self, window: int, softcap: float) -> None:
        self.window, self.softcap = window, softcap

    def __call__(self, q: torch.Tensor, batch, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float):
        out = torch.empty_like(q)
        nd = batch.native_decode
        if nd is not None:  # the decodes through the CPU kernel, which takes the window and the cap
            rows = q if nd.all_rows else q.index_select(0, nd.rows)
            done = native.paged_decode(rows, k_cache, v_cache, nd, scale, window=self.window, softcap=self.softcap)
            if nd.all_rows:
                return done
            out.index_copy_(0, nd.rows, done)
        for row, n, ctx_len, slots in batch.contexts():
            if nd is not None and n == 1:
                continue  # a decode: done above
            first = max(0, ctx_len - n - self.window + 1) if self.window else 0  # the first query's earliest key
            # `slots` end at the context's last position; a sliding batch's (`ForwardBatch.sliding`) start no
            # earlier than `first`, a whole context's at 0
            mine = slots[len(slots) - (ctx_len - first) :]
            k, v = k_cache.index_select(0, mine), v_cache.index_select(0, mine)
            out[row : row + n] = self.attend(q[row : row + n], k, v, ctx_len - n - first, scale)
        return out

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int, scale: float) -> torch.Tensor:
        """`q` [n, H, D] at key positions `offset .. offset + n - 1` of `k`, `v` [L, KVH, D]; returns [n, H, D]."""
        n, kv_len = q.shape[0], k.shape[0]
        qpos = torch.arange(offset, offset + n, device=q.device).unsqueeze(1)
        kpos = torch.arange(kv_len, device=q.device).unsqueeze(0)
        mask = kpos <= qpos
        if self.window:
            mask &= kpos > qpos - self.window
        qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, heads, len, D]
        if not self.softcap:
            out = F.scaled_dot_product_attention(
                qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=qt.shape[1] != kt.shape[1]
            )
            return out.squeeze(0).transpose(0, 1)
        group = qt.shape[1] // kt.shape[1]
        kt, vt = kt.repeat_interleave(group, dim=1), vt.repeat_interleave(group, dim=1)
        scores = torch.matmul(qt, kt.transpose(2, 3)) * scale
        scores = torch.tanh(scores / self.softcap) * self.softcap
        scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(probs, vt).squeeze(0).transpose(0, 1)

    def without_cache(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """One sequence attending to itself (`ForwardBatch.no_cache`)."""
        return self.attend(q, k, v, 0, scale)


def for_layer(window: int, softcap: float) -> WindowedAttention | None:
    """The attention of a layer with this window and cap, or None: the stage's backend attends."""
    return WindowedAttention(window, softcap) if window or softcap else None
