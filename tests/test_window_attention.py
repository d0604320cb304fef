"""A sliding or soft-capped layer's attention (`attention/window.py`): the decodes through the CPU kernel
equal the torch path over the gathered window, and both equal a dense reference over each whole context with the
band and the cap applied as transformers applies them."""

from __future__ import annotations

import pytest
import torch

from ringsched.attention.batch import build_forward_batch
from ringsched.attention.window import WindowedAttention
from ringsched.comm.messages import BatchPlan, PlanEntry
from ringsched.kernels import native
from ringsched.kv.cache import BlockTable

H, KVH, D, BS = 4, 2, 16, 4
LENGTHS = {"a": 3, "b": 13, "c": 30}  # shorter than, near and past the window
CHUNK = ("d", 20, 7)  # a prefill chunk: 7 new tokens after 20 cached


def _batch(native_decode: bool):
    blocks = BlockTable(64, BS)
    entries = []
    for rid, n in LENGTHS.items():
        blocks.ensure(rid, n)
        entries.append(PlanEntry(rid, n - 1, [1], True))
    rid, cached, new = CHUNK
    blocks.ensure(rid, cached + new)
    entries.append(PlanEntry(rid, cached, [1] * new, True))
    plan = BatchPlan(slot=0, seq=0, entries=entries)
    batch, _ = build_forward_batch(plan, blocks, torch.device("cpu"), native_decode)
    return batch, blocks


def _dense(q, k, v, window, softcap, scale):
    """Each query row `i` of a context of `len(k)` at position `len(k) - len(q) + i`: plain softmax attention."""
    n, total = q.shape[0], k.shape[0]
    k, v = k.repeat_interleave(H // KVH, 1), v.repeat_interleave(H // KVH, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    qpos = torch.arange(total - n, total)[:, None]
    kpos = torch.arange(total)[None]
    keep = (kpos <= qpos) & ((kpos > qpos - window) if window else True)
    p = s.masked_fill(~keep, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", p, v)


@pytest.mark.parametrize(("window", "softcap"), [(8, 0.0), (0, 5.0), (8, 5.0)], ids=["window", "cap", "both"])
@pytest.mark.parametrize("kernel", [False, True], ids=["torch", "kernel"])
def test_windowed_attention_matches_a_dense_reference(window, softcap, kernel):
    if kernel and not native.usable_for(torch.float32, "cpu"):
        pytest.skip("no C compiler: the kernel is not built here")
    torch.manual_seed(0)
    batch, blocks = _batch(kernel)
    assert (batch.native_decode is not None) == kernel
    k_cache, v_cache = torch.randn(64 * BS, KVH, D), torch.randn(64 * BS, KVH, D)
    q = torch.randn(batch.num_tokens, H, D)
    out = WindowedAttention(window, softcap)(q, batch, k_cache, v_cache, 0.25)
    for row, n, _, slots in batch.contexts():
        want = _dense(q[row : row + n], k_cache[slots], v_cache[slots], window, softcap, 0.25)
        torch.testing.assert_close(out[row : row + n], want, atol=1e-5, rtol=1e-4)
    assert blocks  # the table outlives the batch's lazily built contexts
