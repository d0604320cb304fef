"""A small decode step's layers as one native call (`kernels/decode_layers.py`) give the per-layer path's results
bit for bit: outputs, residuals and the KV cache, for a first and a later stage, float32, bfloat16, int8 and int4."""

from __future__ import annotations

import pytest
import torch

from ringsched.attention.batch import build_forward_batch
from ringsched.comm.messages import BatchPlan, PlanEntry
from ringsched.kernels import decode_layers, small_linear
from ringsched.kv.cache import BlockTable, KVPool
from ringsched.layout.rank import StageInfo
from ringsched.models.loader import load_stage_model
from ringsched.models.random_model import random_config, write_random_model
from ringsched.weights.model_config import ModelConfig

pytestmark = pytest.mark.skipif(decode_layers.library() is None, reason="no C compiler: the per-layer path runs")


def _run(model, cfg, stage, dtype, plans, whole: bool, proxies, layers=None):
    pool = KVPool(cfg, stage.num_layers, 16, 4, dtype, "cpu")
    blocks = BlockTable(16, 4)
    blocks.assign("a", [0, 1, 2, 3])
    blocks.assign("b", [4, 5, 6, 7])
    blocks.assign("c", [8, 9, 10])
    saved = model.__dict__.pop("decode_layers")
    if whole:
        model.__dict__["decode_layers"] = saved
    outs = []
    try:
        with torch.inference_mode():
            for plan, proxy in zip(plans, proxies, strict=True):
                batch, ids = build_forward_batch(plan, blocks, torch.device("cpu"), native=True)
                seam = {k: v.clone() if k != "kv" else v for k, v in proxy.items()} if not stage.is_first else None
                kw = {"input_ids": ids} if stage.is_first else {"proxy": seam}
                out = model(batch, kv_caches=pool.caches, layers=layers() if layers else None, **kw)
                outs.append({k: v.clone() for k, v in out.items()} if isinstance(out, dict) else out.clone())
    finally:
        model.__dict__["decode_layers"] = saved
    return outs, [(k.clone(), v.clone()) for k, v in pool.caches]


@pytest.mark.parametrize("dtype,quant", [(torch.float32, "none"), (torch.bfloat16, "none"), (torch.float32, "int8"),
                                         (torch.float32, "int4"), (torch.bfloat16, "int4")])  # fmt: skip
@pytest.mark.parametrize("stage", [StageInfo(0, 2, 0, 3), StageInfo(1, 2, 3, 5)])
def test_one_call_equals_the_layer_by_layer_path(tmp_path, dtype, quant, stage):
    cfg_dict = random_config("llama", layers=5, hidden=64, heads=4, kv_heads=2, intermediate=96, vocab=300, tie=True)
    model_dir = write_random_model(tmp_path / "m", cfg_dict, seed=1)
    cfg = ModelConfig.from_dir(model_dir)
    model = load_stage_model(model_dir, stage, dtype=dtype, quantization=quant)
    whole = model.__dict__["decode_layers"]
    assert whole.ok
    # the prompts go in layer by layer (chunks of several tokens are not decodes); then decode steps of 1-3 rows
    plans = [BatchPlan(0, 0, [PlanEntry("a", 0, [5, 6, 7, 8, 9], True), PlanEntry("b", 0, [1, 2, 3], True),
                              PlanEntry("c", 0, [4, 4], True)])]  # fmt: skip
    lens = {"a": 5, "b": 3, "c": 2}
    for step in range(6):
        rids = ["a", "b", "c"][: 1 + step % 3]
        plans.append(BatchPlan(0, step + 1, [PlanEntry(r, lens[r], [10 + step], True) for r in rids]))
        for r in rids:
            lens[r] += 1
    rows = [p.num_tokens for p in plans]
    assert max(rows[1:]) <= whole.max_rows
    g = torch.Generator().manual_seed(0)
    proxies = [{"hidden_states": torch.randn(n, 64, generator=g).to(dtype),
                "residual": torch.randn(n, 64, generator=g).to(dtype), "kv": []} for n in rows]  # fmt: skip
    calls = []
    real = decode_layers.DecodeLayers.__call__
    decode_layers.DecodeLayers.__call__ = lambda self, *a: calls.append(1) or real(self, *a)
    try:
        got, got_kv = _run(model, cfg, stage, dtype, plans, True, proxies)
    finally:
        decode_layers.DecodeLayers.__call__ = real
    want, want_kv = _run(model, cfg, stage, dtype, plans, False, proxies)
    assert len(calls) == len(plans) - 1  # every decode step went through the one call, the prompts did not
    for a, b in zip(got, want, strict=True):
        if isinstance(a, dict):
            assert torch.equal(a["hidden_states"], b["hidden_states"]) and torch.equal(a["residual"], b["residual"])
        else:
            assert torch.equal(a, b)
    for (k1, v1), (k2, v2) in zip(got_kv, want_kv, strict=True):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


def test_steps_beyond_the_kernels_rows_take_the_layer_path(tmp_path):
    cfg_dict = random_config("llama", layers=2, hidden=64, heads=4, kv_heads=2, intermediate=96, vocab=300, tie=True)
    model = load_stage_model(write_random_model(tmp_path / "m", cfg_dict, seed=1), StageInfo(0, 1, 0, 2))
    whole = model.__dict__["decode_layers"]
    assert whole.max_rows == small_linear.MAX_ROWS[torch.float32]


def test_a_flexible_cuts_range_runs_in_one_call_and_an_iterator_layer_by_layer(tmp_path):
    """A flexible cut known before the step (a range of the held layers) takes the one call, with the per-layer
    path's results; one decided while the layers run (an iterator) runs them one by one."""
    cfg_dict = random_config("llama", layers=5, hidden=64, heads=4, kv_heads=2, intermediate=96, vocab=300, tie=True)
    model_dir = write_random_model(tmp_path / "m", cfg_dict, seed=1)
    cfg, stage = ModelConfig.from_dir(model_dir), StageInfo(0, 2, 0, 4)
    model = load_stage_model(model_dir, stage)
    plans = [BatchPlan(0, 0, [PlanEntry("a", 0, [5, 6, 7], True), PlanEntry("b", 0, [1, 2], True)])]
    for s in range(3):
        plans.append(BatchPlan(0, s + 1, [PlanEntry("a", 3 + s, [9], True), PlanEntry("b", 2 + s, [8], True)]))
    proxies = [{}] * len(plans)
    calls = []
    real = decode_layers.DecodeLayers.__call__
    decode_layers.DecodeLayers.__call__ = lambda self, *a: calls.append(list(a[-1])) or real(self, *a)
    try:
        got, got_kv = _run(model, cfg, stage, torch.float32, plans, True, proxies, layers=lambda: range(0, 3))
        assert calls == [[0, 1, 2]] * 3  # the three decode steps, the cut's layers only
        calls.clear()
        it, it_kv = _run(model, cfg, stage, torch.float32, plans, True, proxies, layers=lambda: iter(range(0, 3)))
        assert not calls
    finally:
        decode_layers.DecodeLayers.__call__ = real
    for a, b in zip(got, it, strict=True):
        assert torch.equal(a["hidden_states"], b["hidden_states"]) and torch.equal(a["residual"], b["residual"])
    for i, ((k1, v1), (k2, v2)) in enumerate(zip(got_kv, it_kv, strict=True)):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
        assert (k1.abs().sum() > 0) == (i < 3)  # the layer past the cut was not run
