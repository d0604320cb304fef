"""The Triton layer ops (`kernels/triton_layer_ops.py`) against the torch path they stand for, under Triton's
interpreter on CPU: add + RMSNorm, rotary + KV writes, SiLU x up, and a decode layer through them."""

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels' first import
pytest.importorskip("triton")

from ringsched.attention.backend import select_backend  # noqa: E402
from ringsched.bench.op_count import device_path  # noqa: E402
from ringsched.comm.messages import BatchPlan, PlanEntry  # noqa: E402
from ringsched.kernels import triton_layer_ops as ops  # noqa: E402
from ringsched.kv.cache import BlockTable, KVPool  # noqa: E402
from ringsched.layout.rank import StageInfo  # noqa: E402
from ringsched.models.llama import StageModel  # noqa: E402
from ringsched.models.random_model import random_config  # noqa: E402
from ringsched.models.rmsnorm import RMSNorm  # noqa: E402
from ringsched.models.rope import Rotary  # noqa: E402
from ringsched.weights.model_config import ModelConfig  # noqa: E402


@pytest.mark.parametrize("first", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rmsnorm_matches_torch(first, dtype):
    torch.manual_seed(0)
    x, res = torch.randn(5, 96, dtype=dtype), torch.randn(5, 96, dtype=dtype)
    norm = RMSNorm(96, 1e-5).to(dtype)
    torch.nn.init.normal_(norm.weight)
    want, want_res = norm.add_forward(x.clone(), None if first else res.clone())
    got, got_res = ops.add_rmsnorm(x.clone(), None if first else res.clone(), norm.weight, norm.eps)
    # float32: the residual sum exact. Triton's interpreter rounds float32 to bfloat16 by truncation (a GPU rounds
    # to nearest): within one bfloat16 step of torch's there.
    exact = dtype == torch.float32
    tol = dict(atol=1e-5, rtol=1e-5) if exact else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got_res, want_res, atol=0, rtol=0 if exact else 2**-7)
    torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (3, 1)])
def test_rope_store_matches_rotary_and_cache_writes(heads, kv_heads):
    torch.manual_seed(1)
    d, rows, slots_n = 16, 4, 40
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * d)
    positions = torch.tensor([0, 7, 3, 30])
    slots = torch.tensor([5, 11, 39, 0])
    rot = Rotary(d, 10000.0)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    want_q, want_k = rot(positions, q.reshape(rows, heads, d), k.reshape(rows, kv_heads, d))
    kc, vc = torch.zeros(slots_n, kv_heads, d), torch.zeros(slots_n, kv_heads, d)
    got_q = ops.rope_store(qkv, heads, kv_heads, d, positions, rot.tables(positions), kc, vc, slots)
    torch.testing.assert_close(got_q, want_q, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(kc[slots], want_k, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(vc[slots], v.reshape(rows, kv_heads, d), atol=0, rtol=0)
    untouched = torch.ones(slots_n, dtype=torch.bool)
    untouched[slots] = False
    assert not kc[untouched].any() and not vc[untouched].any()


def test_silu_mul_matches_torch():
    torch.manual_seed(2)
    gu = torch.randn(3, 2 * 1500)  # more columns than one program's block
    g, u = gu.split(1500, dim=-1)
    torch.testing.assert_close(ops.silu_mul(gu), torch.nn.functional.silu(g) * u, atol=1e-6, rtol=1e-6)


def _steps(fused: bool) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Logits and greedy tokens of a tiny random model prefilling two prompts in one step, then decoding both
    three steps, on the device path (`bench/op_count.device_path`) with or without the Triton layer ops."""
    cfg = ModelConfig.from_dict(random_config("llama", 2, 64, 4, 2, 96, 300, tie=True))
    torch.manual_seed(0)
    model = StageModel(cfg, StageInfo(0, 1, 0, cfg.num_layers))
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.2)
    model.prepare_linears("none")
    device_path(model, fused)
    backend = select_backend("triton", "cpu", torch.float32)
    blocks, pool = BlockTable(32, 16), KVPool(cfg, cfg.num_layers, 32, 16, torch.float32, "cpu")
    feed = {"a": (0, list(range(3, 23))), "b": (0, list(range(40, 53)))}
    logits, tokens = [], []
    with torch.no_grad():
        for _ in range(4):
            entries = []
            for rid, (start, ids) in feed.items():
                blocks.ensure(rid, start + len(ids))
                entries.append(PlanEntry(rid, start, ids, True))
            batch, ids = backend.forward_batch(BatchPlan(slot=0, seq=0, entries=entries), blocks, "cpu")
            logits.append(model.compute_logits(model(batch, input_ids=ids, kv_caches=pool.caches)))
            tokens.append(logits[-1].argmax(-1).tolist())
            feed = {e.rid: (e.start + len(e.token_ids), [t]) for e, t in zip(entries, tokens[-1], strict=True)}
    return logits, tokens


def test_a_model_through_the_triton_layer_ops_matches_torch_ops():
    (want, want_tokens), (got, got_tokens) = _steps(fused=False), _steps(fused=True)
    assert got_tokens == want_tokens
    for w, g in zip(want, got, strict=True):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
