"""The Triton attention kernels (`kernels/triton_attention.py`) against dense softmax attention over each
sequence's gathered keys; and the `triton` backend against `torch` through a tiny random model. On a machine
without CUDA the kernels run under Triton's interpreter; with CUDA, compiled on the GPU.

Fast lane: a small covering set (batch 1 and a few; contexts of 1 key, a block boundary, a few hundred; GQA 1, 2,
8; blocks of 16 and 32; prefill with and without a cached prefix; chunked extend). Slow lane: a sampled sweep up
to 64 sequences and 8k keys (without its GQA-1 cases under the interpreter)."""

from __future__ import annotations

import os

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported: no GPU compiler for CPU tensors

import pytest  # noqa: E402

pytest.importorskip("triton")

from ringsched.attention.backend import check_backend, select_backend  # noqa: E402
from ringsched.attention.ring import merge_all  # noqa: E402
from ringsched.comm.messages import BatchPlan, PlanEntry  # noqa: E402
from ringsched.kernels import triton_attention as ta  # noqa: E402
from ringsched.kv.cache import BlockTable, KVPool  # noqa: E402
from ringsched.layout.rank import StageInfo  # noqa: E402
from ringsched.models.llama import StageModel  # noqa: E402
from ringsched.models.random_model import random_config  # noqa: E402
from ringsched.weights.model_config import ModelConfig  # noqa: E402

TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


class Pool:
    """A pool of `kv_heads` x `dim` keys and values in `bs`-token blocks, and sequences of given lengths whose
    blocks are scattered through it (shuffled block numbers)."""

    def __init__(self, lens: list[int], kv_heads: int, dim: int, bs: int, dtype: torch.dtype, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        need = [-(-n // bs) for n in lens]
        perm = torch.randperm(sum(need) + 2, generator=g)  # two blocks no sequence holds
        self.tables = torch.zeros(len(lens), max(need), dtype=torch.int32)
        at = 0
        for i, nb in enumerate(need):
            self.tables[i, :nb] = perm[at : at + nb].to(torch.int32)
            at += nb
        slots = (sum(need) + 2) * bs
        self.k = torch.randn(slots, kv_heads, dim, generator=g).to(dtype)
        self.v = torch.randn(slots, kv_heads, dim, generator=g).to(dtype)
        self.lens, self.bs = lens, bs
        self.dk, self.dv, self.dtables = self.k.to(DEVICE), self.v.to(DEVICE), self.tables.to(DEVICE)

    def slots(self, i: int) -> torch.Tensor:
        pos = torch.arange(self.lens[i])
        return self.tables[i].long()[pos // self.bs] * self.bs + pos % self.bs


def reference(q, k, v, q_pos, scale):
    """Dense causal attention in float32: q `[n, H, D]` at `q_pos` over k, v `[m, KVH, D]` at 0..m-1; the output
    `[n, H, D]` and LSE `[n, H]`."""
    g = q.shape[1] // k.shape[1]
    k, v = (x.float().repeat_interleave(g, dim=1) for x in (k, v))
    s = torch.einsum("nhd,mhd->hnm", q.float(), k) * scale
    s = s.masked_fill(torch.arange(k.shape[0])[None, :] > q_pos[:, None], float("-inf"))
    return torch.einsum("hnm,mhd->nhd", s.softmax(-1), v), torch.logsumexp(s, -1).T


def check_decode(lens, heads, kv_heads, dim, bs, dtype, splits=None, seed=0):
    pool = Pool(lens, kv_heads, dim, bs, dtype, seed)
    q = torch.randn(len(lens), heads, dim, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    out, lse = ta.paged_decode(q.to(DEVICE), pool.dk, pool.dv, pool.dtables, lens_t, bs, dim**-0.5, max(lens), splits)
    assert out.dtype == dtype and out.shape == q.shape
    out, lse = out.cpu(), lse.cpu()
    for i, n in enumerate(lens):
        s = pool.slots(i)
        want, want_lse = reference(q[i : i + 1], pool.k[s], pool.v[s], torch.tensor([n - 1]), dim**-0.5)
        torch.testing.assert_close(out[i].float(), want[0], **TOL[dtype])
        torch.testing.assert_close(lse[i], want_lse[0], atol=1e-4, rtol=1e-4)


def check_extend(lens, news, heads, kv_heads, dim, bs, dtype, seed=0):
    """Sequence i has `lens[i]` keys, the last `news[i]` of them its new tokens (the rest a cached prefix)."""
    pool = Pool(lens, kv_heads, dim, bs, dtype, seed)
    q = torch.randn(sum(news), heads, dim, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    starts = torch.tensor([0, *news[:-1]]).cumsum(0)
    positions = torch.cat([torch.arange(n - k, n) for n, k in zip(lens, news, strict=True)])
    i32 = dict(dtype=torch.int32, device=DEVICE)
    out = ta.paged_extend(q.to(DEVICE), pool.dk, pool.dv, pool.dtables, torch.tensor(lens, **i32),
                          starts.to(**i32), torch.tensor(news, **i32), positions.to(DEVICE), bs, dim**-0.5,
                          max(news)).cpu()  # fmt: skip
    for i, (n, k) in enumerate(zip(lens, news, strict=True)):
        s, rows = pool.slots(i), slice(int(starts[i]), int(starts[i]) + k)
        want, _ = reference(q[rows], pool.k[s], pool.v[s], torch.arange(n - k, n), dim**-0.5)
        torch.testing.assert_close(out[rows].float(), want, **TOL[dtype])


DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "lens, heads, kv_heads, bs",
    [
        ([1], 2, 2, 16),  # one key: the new token's own
        ([16, 17, 32, 33], 4, 2, 16),  # block boundaries
        ([300, 7], 8, 1, 32),  # a few hundred keys, GQA 8
        ([64, 1, 257], 2, 1, 32),
    ],
)
def test_decode_matches_dense_attention(lens, heads, kv_heads, bs, dtype):
    check_decode(lens, heads, kv_heads, 32, bs, dtype)


@pytest.mark.parametrize("splits", [1, 3, 8])
def test_decode_output_does_not_depend_on_the_split_count(splits):
    # 8 splits of 100 keys: several splits past the shorter contexts (LSE -inf, weight 0 in the merge).
    check_decode([100, 9, 1], 4, 4, 16, 16, torch.float32, splits=splits)


def test_split_partials_merge_like_ring_attention():
    pool = Pool([200, 50], 2, 16, 16, torch.float32)
    q = torch.randn(2, 4, 16, device=DEVICE)
    lens = torch.tensor([200, 50], dtype=torch.int32, device=DEVICE)
    outs, lses = ta.decode_partials(q, pool.dk, pool.dv, pool.dtables, lens, 16, 0.25, splits=4)
    assert outs.shape == (2, 4, 4, 16) and lses.shape == (2, 4, 4)
    assert torch.isinf(lses[1, :, 3]).all()  # 50 keys in splits of 64: the last one is empty
    want, want_lse = merge_all(list(outs.unbind(2)), list(lses.unbind(2)))
    got, got_lse = ta.merge_partials(outs, lses)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got_lse, want_lse, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "lens, news, heads, kv_heads, bs",
    [
        ([40], [40], 2, 2, 16),  # a whole prompt, no prefix
        ([100, 17], [30, 17], 4, 2, 32),  # a cached prefix of 70 (not a block multiple) and a fresh prompt
        ([300, 65], [90, 1], 8, 1, 16),  # a long chunk after a prefix and a one-token extend
    ],
)
def test_extend_matches_dense_causal_attention(lens, news, heads, kv_heads, bs, dtype):
    check_extend(lens, news, heads, kv_heads, 32, bs, dtype)


def _model_steps(backend_name: str, chunks: list[int], decodes: int, device: str = "cpu") -> list[torch.Tensor]:
    """Logits of a tiny random model prefilling two prompts in `chunks`-token chunks (each chunk over the KV
    of the earlier ones, the second prompt starting later), then decoding both, attending with the backend."""
    cfg = ModelConfig.from_dict(random_config("llama", 2, 64, 8, 2, 96, 300, tie=True))
    torch.manual_seed(0)
    model = StageModel(cfg, StageInfo(0, 1, 0, cfg.num_layers))
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.2)
    model.to(device)
    backend = select_backend(backend_name, device, torch.float32)
    blocks, pool = BlockTable(32, 16), KVPool(cfg, cfg.num_layers, 32, 16, torch.float32, device)
    prompts = {"a": list(range(3, 3 + sum(chunks))), "b": list(range(40, 40 + chunks[-1]))}
    steps = [[("a", 0, c) for c in chunks[:1]]]
    steps += [[("a", sum(chunks[:i]), c), ("b", 0, c)] if i == len(chunks) - 1 else [("a", sum(chunks[:i]), c)]
              for i, c in enumerate(chunks) if i]  # fmt: skip
    logits, last = [], {}
    with torch.no_grad():
        for step in steps:
            entries = []
            for rid, start, n in step:
                blocks.ensure(rid, start + n)
                entries.append(PlanEntry(rid, start, prompts[rid][start : start + n], True))
            logits.append(_run(model, backend, blocks, pool, entries, last))
        for t in range(decodes):
            entries = []
            for rid in ("a", "b"):
                pos = len(prompts[rid]) + t
                blocks.ensure(rid, pos + 1)
                entries.append(PlanEntry(rid, pos, [last[rid]], True))
            logits.append(_run(model, backend, blocks, pool, entries, last))
    return logits


def _run(model, backend, blocks, pool, entries, last) -> torch.Tensor:
    batch, ids = backend.forward_batch(BatchPlan(slot=0, seq=0, entries=entries), blocks, ids_device(pool))
    out = model.compute_logits(model(batch, input_ids=ids, kv_caches=pool.caches))
    for e, row in zip(entries, out.argmax(-1).tolist(), strict=True):
        last[e.rid] = row
    return out


def ids_device(pool: KVPool) -> torch.device:
    return pool.caches[0][0].device


def test_triton_backend_matches_torch_through_a_model():
    want, got = _model_steps("torch", [20, 13], 2, DEVICE), _model_steps("triton", [20, 13], 2, DEVICE)
    assert len(want) == len(got) == 4
    for w, g in zip(want, got, strict=True):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


def test_backend_names():
    assert check_backend("triton") == "triton"
    with pytest.raises(ValueError, match="--attention-backend"):
        check_backend("flash")
    assert select_backend("auto", "cpu", torch.float16).name == "torch"  # the native kernel takes no float16
    assert select_backend("triton", "cpu", torch.float32).name == "triton"


SWEEP = [  # (batch, longest context, heads, kv heads, block size, dtype): a sample of the full product
    (64, 300, 4, 4, 16, torch.float32),
    (64, 200, 8, 1, 32, torch.bfloat16),
    (16, 1024, 4, 2, 32, torch.float32),
    (8, 2048, 8, 2, 16, torch.bfloat16),
    (2, 8192, 2, 1, 16, torch.float32),
    (2, 8192, 8, 8, 32, torch.bfloat16),
    (1, 8192, 8, 1, 32, torch.float32),
]
if DEVICE == "cpu":  # under the interpreter (~30 s of the sweep's ~90 s on two cores) without the two GQA-1 cases:
    # every batch size, context, GQA 2 and 8, both block sizes and dtypes remain; GQA 1 is the fast lane's
    SWEEP = [case for case in SWEEP if case[2] != case[3]]


@pytest.mark.slow
@pytest.mark.parametrize("batch, longest, heads, kv_heads, bs, dtype", SWEEP)
def test_decode_sweep(batch, longest, heads, kv_heads, bs, dtype):
    lens = torch.randint(1, longest + 1, (batch,), generator=torch.Generator().manual_seed(batch)).tolist()
    lens[0] = longest
    check_decode(lens, heads, kv_heads, 64, bs, dtype, seed=batch)


@pytest.mark.slow
@pytest.mark.parametrize("batch, longest, heads, kv_heads, bs, dtype", [c for c in SWEEP if c[1] >= 1024])
def test_extend_sweep(batch, longest, heads, kv_heads, bs, dtype):
    lens = torch.randint(1, longest + 1, (batch,), generator=torch.Generator().manual_seed(batch)).tolist()
    lens[0] = longest
    # a chunk of up to 128 tokens (two row tiles) after a cached prefix of up to 1k, of up to 64 (one) after up to 8k:
    # the interpreter's time grows with the chunk times the context; the compiled kernels ran chunks of 512 on a GPU
    news = [max(1, min(n // 4, 128 if longest <= 1024 else 64)) for n in lens]
    check_extend(lens, news, heads, kv_heads, 64, bs, dtype, seed=batch)
