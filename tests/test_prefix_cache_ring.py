"""Prefix caching on the real ring: PP=2 stages computing only the uncached tokens, the same greedy tokens as
without the cache, eviction through a small pool, and a storm of aborts that leaves no block held."""

import random
import time

import pytest
import torch
from ring_utils import run_staggered, stage_kv_usage
from test_model_reference import hf_greedy

from ringsched.engine import Engine
from ringsched.kv.cache import kv_bytes_per_token
from ringsched.sampling.params import SamplingParams
from ringsched.weights.model_config import ModelConfig

pytestmark = pytest.mark.slow  # real model or several processes: the full suite's

KW = dict(threads_per_stage=1, log_level="warning")
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def stage_tokens(llm: Engine) -> dict[int, int]:
    """Tokens each stage computed so far, once every stage's report has caught up with stage 0's."""
    llm.wait_idle()
    time.sleep(1.2)  # two report periods: the last micro-batch is in every stage's figure
    llm.poll(0.1)
    return {s["stage"]: s["tokens"] for s in llm.supervisor.stats.values()}


def test_every_stage_computes_only_the_uncached_tokens_and_the_tokens_do_not_change(hf_smol):
    rng = random.Random(0)
    head = [rng.randrange(100, 40000) for _ in range(200)]
    prompts = [head + [rng.randrange(100, 40000) for _ in range(16)] for _ in range(8)]
    with Engine(pp_size=2, kv_cache_memory="64M", **KW) as llm:
        first = llm.generate(prompts[:1], GREEDY)[0].token_ids  # fills the cache
        outs = [first] + [o.token_ids for o in llm.generate(prompts[1:], GREEDY)]
        tokens, stats = stage_tokens(llm), llm.wait_idle()
    # 200 shared tokens are 12 whole blocks (192 tokens) that the 7 later requests found cached.
    assert stats["prefix_cache_hits"] == 7 * 192 and stats["prefix_cache_queries"] == 8 * 216
    # Without the cache each stage computes every prompt token and 7 decode steps a request.
    assert tokens == {0: 8 * (216 + 7) - 7 * 192, 1: 8 * (216 + 7) - 7 * 192}
    # The tokens are those of transformers, which computes every prompt whole (no prefix cache): its own KV cache
    # for the decodes, not a forward over the whole sequence for each token (most of this test's time, that was).
    for ids, got in zip(prompts[:2], outs, strict=False):
        assert got == hf_greedy(hf_smol[0], ids, 8)
    assert len({tuple(o) for o in outs}) > 1


def test_eviction_through_a_small_pool_completes_everything_unchanged(tiny_llama_dir):
    rng = random.Random(1)
    heads = [[rng.randrange(3, 500) for _ in range(48)] for _ in range(20)]
    work = []
    for _ in range(200):  # varying prefixes: a few heads, cut at varying lengths, with a distinct tail
        ids = rng.choice(heads)[: rng.randrange(8, 49)] + [rng.randrange(3, 500) for _ in range(rng.randrange(1, 9))]
        work.append((ids, SamplingParams(max_tokens=rng.randrange(1, 17), temperature=0.0, ignore_eos=True)))
    # A pool holding 10% of the requests' tokens (each stage holds half the layers).
    need = sum(len(ids) + p.max_tokens for ids, p in work)
    cfg = ModelConfig.from_dir(tiny_llama_dir)
    pool = need // 10 * kv_bytes_per_token(cfg, cfg.num_layers // 2, torch.float32)
    kw = dict(model=str(tiny_llama_dir), pp_size=2, kv_cache_memory=str(pool), max_running_requests=16, **KW)
    with Engine(enable_prefix_caching=False, **kw) as llm:
        expected = run_staggered(llm, work, gap=0.0)
    with Engine(enable_prefix_caching=True, **kw) as llm:
        got = run_staggered(llm, work, gap=0.0)
        stats = llm.wait_idle()
        assert stage_kv_usage(llm) == {0: 0.0, 1: 0.0}
    assert got == expected
    assert stats["prefix_cache_hits"] > 0 and stats["kv_usage"] == 0
    assert 0 < stats["kv_cached_idle_blocks"] <= llm.supervisor.info[0]["kv_tokens"] // 16


def test_an_abort_storm_with_the_cache_on_leaves_no_block_held():
    rng = random.Random(2)
    head = [rng.randrange(100, 40000) for _ in range(300)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    with Engine(pp_size=2, kv_cache_memory="64M", max_running_requests=8, chunked_prefill_size=64, **KW) as llm:
        rids = []
        for _ in range(40):
            ids = head[: rng.randrange(20, 301)] + [rng.randrange(100, 40000) for _ in range(rng.randrange(1, 20))]
            rids.append(llm.submit(ids, params))
        # Aborts at every phase: waiting (beyond the 8 running), mid-prefill (300-token prompts in 64-token
        # chunks), mid-decode, and a few let finish; a random pace in between.
        phases = {r: rng.choice(["now", "soon", "later", "never"]) for r in rids}
        seen: dict[str, int] = {r: 0 for r in rids}
        ends: dict[str, str] = {}
        for r in rids:
            if phases[r] == "now":
                llm.abort(r)
        deadline = time.monotonic() + 180
        while len(ends) < len(rids):
            assert time.monotonic() < deadline, f"{len(rids) - len(ends)} requests never ended"
            for o in llm.poll(0.01):
                seen[o.rid] += len(o.token_ids)
                if o.finish_reason:
                    ends[o.rid] = o.finish_reason
            for r in rids:
                if r in ends:
                    continue
                if (phases[r] == "soon" and rng.random() < 0.05) or (phases[r] == "later" and seen[r] >= 3):
                    llm.abort(r)
                    phases[r] = "done"
        assert {ends[r] for r in rids if phases[r] == "never"} <= {"length"}
        assert "abort" in ends.values()
        assert stage_kv_usage(llm) == {0: 0.0, 1: 0.0}
        stats = llm.wait_idle()
        assert stats["running"] == 0 and stats["waiting"] == 0 and stats["prefix_cache_hits"] > 0
        assert all(s["kv_used_blocks"] == 0 for s in llm.supervisor.stats.values())
