"""Context parallelism end to end (real stage processes, ZMQ, gloo, shared-memory collectives, SmolLM2): CP=2 x
PP=2 gives transformers' greedy tokens on short and long prompts (split chunks by ring attention, short ones and
decodes by travelling queries), each CP rank computing its half of the tokens and every rank freeing its KV; a
request larger than one rank's pool is served at CP=2 and refused at CP=1; speculative drafts give the same tokens;
an abort while a long prompt's chunks are in flight frees the KV on all four ranks of CP=2 x PP=2."""

import random

import pytest
import torch
from ring_utils import abort_with_chunks_in_flight, stage_kv_usage
from test_model_reference import hf_greedy, prompt_ids

from ringsched.engine import Engine
from ringsched.kv.cache import kv_bytes_per_token
from ringsched.kv.cp_blocks import request_capacity
from ringsched.sampling.params import SamplingParams
from ringsched.weights.model_config import ModelConfig

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
KW = dict(kv_cache_memory="128M", log_level="warning", chunked_prefill_size=256, threads_per_stage=1)


def _random_prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 49152) for _ in range(n)]


@pytest.fixture(scope="module")
def cases(hf_smol):
    """Prompts of 3 (one rank), a chat turn, 100 and 1,100 tokens (five chunks of 256: the ring with earlier
    chunks' KV), and transformers' greedy continuations."""
    hf, tok = hf_smol
    prompts = [prompt_ids(tok, 0)[:3], prompt_ids(tok, 4), _random_prompt(100, 1), _random_prompt(1100, 2)]
    with torch.no_grad():
        return prompts, [hf_greedy(hf, ids, GREEDY.max_tokens) for ids in prompts]


def _run(prompts, **kw) -> tuple[list[list[int]], dict, dict]:
    with Engine(**{**KW, **kw}) as llm:
        outs = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        usage = stage_kv_usage(llm)
        stats = {r: dict(s) for r, s in llm.supervisor.stats.items()}
    return outs, usage, stats


def test_cp2_pp2_matches_transformers(cases):
    """CP=2 x PP=2, four processes (CP=2 alone runs the ring's workload in test_ring.py; CP=1 is transformers'
    too, test_model_reference.py)."""
    prompts, want = cases
    pp = 2
    outs, usage, stats = _run(prompts, cp_size=2, pp_size=pp)
    assert outs == want
    assert len(usage) == 2 * pp and set(usage.values()) == {0.0}, f"KV not freed on every rank: {usage}"
    # Each stage computed every token once, split between its two CP ranks about evenly.
    computed = sum(len(p) for p in prompts) + len(prompts) * (GREEDY.max_tokens - 1)
    for stage in range(pp):
        ranks = [s for s in stats.values() if s["stage"] == stage]
        assert sorted(s["cp"] for s in ranks) == [0, 1]
        assert sum(s["tokens"] for s in ranks) == computed
        assert all(0.4 < s["tokens"] / computed < 0.6 for s in ranks), [s["tokens"] for s in ranks]
        assert all(s["cp_ring_bytes"] > 0 for s in ranks)


def test_a_request_larger_than_one_ranks_pool(smollm2_dir, hf_smol):
    """A pool of ~600 tokens per rank: an 800-token prompt is refused at CP=1 and served at CP=2."""
    mcfg = ModelConfig.from_dir(smollm2_dir)
    per_token = kv_bytes_per_token(mcfg, mcfg.num_layers, torch.float32)
    kw = {**KW, "kv_cache_memory": str(600 * per_token), "max_model_len": 4096}
    prompt = _random_prompt(800, 3)
    with Engine(**kw) as llm:
        out = llm.generate([prompt], GREEDY)[0]
        rank_tokens = llm.supervisor.info[0]["kv_tokens"]
    assert rank_tokens < len(prompt) + GREEDY.max_tokens <= request_capacity(rank_tokens, 2)
    assert out.finish_reason == "error" and "--cp-size" in out.error, out
    with Engine(cp_size=2, **kw) as llm:
        out = llm.generate([prompt], GREEDY)[0]
        info = dict(llm.supervisor.info)
        usage = stage_kv_usage(llm)
    assert out.finish_reason == "length", out
    assert all(i["kv_tokens"] == rank_tokens for i in info.values())
    assert all(i["request_kv_tokens"] == request_capacity(rank_tokens, 2) for i in info.values())
    with torch.no_grad():
        assert out.token_ids == hf_greedy(hf_smol[0], prompt, GREEDY.max_tokens)
    assert set(usage.values()) == {0.0}


def test_drafts_and_an_abort_with_chunks_in_flight_on_every_cp_rank(hf_smol):
    """CP=2 x PP=2 with speculative drafts (placed over the CP ranks, rejected ones dropped on every rank): a looping
    prompt and a random one give transformers' greedy tokens, drafts kept; then an abort while a long prompt's
    chunks are in flight frees the KV on all four ranks, and the engine still serves."""
    long = _random_prompt(2000, 7)
    prompts = [[9, 10, 11, 12, 13] * 8, _random_prompt(40, 8)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    with torch.no_grad():
        want = [hf_greedy(hf_smol[0], ids, params.max_tokens) for ids in prompts]
    spec = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 1, "adaptive": False}
    kw = {**KW, "chunked_prefill_size": 32, "speculative_config": spec}
    with Engine(cp_size=2, pp_size=2, pp_async_batch_depth=1, **kw) as llm:
        assert [o.token_ids for o in llm.generate(prompts, params)] == want
        assert llm.wait_idle().get("spec_accepted_tokens", 0) > 0
        abort_with_chunks_in_flight(llm, long, GREEDY, in_flight=2)
        usage = stage_kv_usage(llm)
        assert usage == dict.fromkeys(range(4), 0.0), f"KV not freed on every rank: {usage}"
        assert llm.generate(prompts[1:], params)[0].token_ids == want[1]
