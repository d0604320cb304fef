"""Decode steps on static buffers (`stage/static_batches.py`, the CUDA-graph path without capture): stage 0's
bucket choice, and every bucket's padded step giving the eager step's logits for the real rows."""

import pytest
import torch
from ring_utils import stage_kv_usage

from ringsched.attention.backend import select_backend
from ringsched.comm.messages import BatchPlan, PlanEntry
from ringsched.config import STATIC_BATCHES_ENV
from ringsched.engine import Engine
from ringsched.kv.cache import BlockTable, KVPool
from ringsched.layout.rank import StageInfo
from ringsched.models.llama import StageModel
from ringsched.models.random_model import random_config
from ringsched.sampling.params import SamplingParams
from ringsched.stage.flex_ring import FixedCut
from ringsched.stage.static_batches import SCRATCH_RID, Buckets, EagerForward, StaticForward, buckets
from ringsched.weights.model_config import ModelConfig


def test_buckets_and_which_plans_take_one():
    assert buckets(256)[:6] == [1, 2, 4, 8, 16, 24] and buckets(256)[-1] == 256
    assert buckets(20) == [1, 2, 4, 8, 16, 20] and buckets(3) == [1, 2, 3]
    choose = Buckets(buckets(32)).choose
    decodes = [PlanEntry(f"r{i}", 10, [5], True) for i in range(9)]
    cases = {
        "9 decodes": (decodes, 16),
        "one decode": (decodes[:1], 1),
        "a prefill chunk beside": (decodes + [PlanEntry("p", 0, [1, 2, 3], True)], 0),
        "a drafted decode": (decodes[:2] + [PlanEntry("d", 10, [5, 6], True, drafts=1)], 0),
        "more rows than the largest bucket": ([PlanEntry(f"r{i}", 10, [5], True) for i in range(33)], 0),
    }
    for name, (entries, want) in cases.items():
        plan = BatchPlan(0, 0, entries=entries)
        choose(plan)
        assert plan.graph_rows == want, name
    plan = BatchPlan(0, 0, entries=decodes)
    Buckets([]).choose(plan)  # eager stages (--enforce-eager, or no static path)
    assert plan.graph_rows == 0


def _stage(num_blocks: int = 72):
    cfg = ModelConfig.from_dict(random_config("llama", 2, 64, 4, 2, 96, 300, tie=True))
    torch.manual_seed(0)
    model = StageModel(cfg, StageInfo(0, 1, 0, cfg.num_layers))
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.2)
    model.eval().prepare_linears("none")
    blocks = BlockTable(num_blocks - 1, 16)  # the last block set aside for padding rows
    pool = KVPool(cfg, cfg.num_layers, num_blocks, 16, torch.float32, "cpu")
    backend = select_backend("auto", "cpu", torch.float32)
    eager = EagerForward(model, backend, blocks, pool, FixedCut(model.stage, torch.device("cpu")), "cpu")
    return model, blocks, eager, StaticForward(eager, num_blocks - 1, 64)


def test_every_bucket_with_padding_gives_the_eager_logits():
    model, blocks, eager, static = _stage()
    sizes = buckets(24)
    # Each bucket twice: padded past 2 rows, then one real row over the buffers the first step filled.
    for b, n in [(size, n) for size in sizes for n in (max(size - 3, 1), 1)]:
        entries = []
        for i in range(n):
            rid, ctx = f"b{b}-{i}", 3 + (5 * i) % 40
            assert blocks.ensure(rid, ctx)
            entries.append(PlanEntry(rid, ctx - 1, [7 + i], True))
        with torch.inference_mode():
            _, want, _ = eager(BatchPlan(0, b, entries=entries), None)
            plan = BatchPlan(0, b, entries=entries, graph_rows=b)
            batch, got, _ = static(plan, None)
            assert batch.num_tokens == b and got.shape[0] == n
            torch.testing.assert_close(model.compute_logits(got), model.compute_logits(want), atol=1e-5, rtol=1e-5)
        for e in entries:
            blocks.free(e.rid)
    assert static.stats()["static_steps"] == {str(b): 2 for b in sizes}
    assert blocks.used_blocks == 0 and blocks.tables[SCRATCH_RID] == [71]  # padding held no block of the table's


def _ring(pp: int, depth: int) -> tuple[list[list[int]], dict]:
    """Ten greedy requests of 3 to 30 new tokens through a real ring: each one's tokens, and every stage's stats."""
    prompts = [[100 + (i * 7 + j) % 300 for j in range(3 + i % 5)] for i in range(10)]
    params = [SamplingParams(max_tokens=3 + 3 * i, temperature=0.0, ignore_eos=True) for i in range(10)]
    kw = dict(pp_size=pp, pp_async_batch_depth=depth, threads_per_stage=1, kv_cache_memory="64M", log_level="warning")
    with Engine(**kw) as llm:
        outs = [o.token_ids for o in llm.generate(prompts, params)]
        usage = stage_kv_usage(llm)
        stats = dict(llm.supervisor.stats)
    assert usage == {r: 0.0 for r in range(pp)}, f"KV not freed on every stage: {usage}"
    return outs, stats


@pytest.mark.slow
def test_a_ring_on_static_buffers_gives_the_eager_tokens_every_stage_in_the_plans_bucket(monkeypatch):
    eager, eager_stats = _ring(2, 1)
    assert all("static_steps" not in s for s in eager_stats.values())
    monkeypatch.setenv(STATIC_BATCHES_ENV, "1")  # the stage processes take the CUDA-graph path, without capture
    static, stats = _ring(2, 1)
    assert static == eager
    steps = [s["static_steps"] for s in stats.values()]
    assert all(s == steps[0] for s in steps), steps  # every stage ran each plan in the bucket the plan named
    assert len(steps[0]) >= 3, steps  # the requests end one by one: several buckets, most of them padded
