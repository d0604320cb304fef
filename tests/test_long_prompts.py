"""Long prompts through the pipeline, end to end (real stage processes, ZMQ, gloo, SmolLM2): a prompt's prefill
chunks in several in-flight micro-batches at once, with fixed and dynamic chunk sizes, give PP=1's tokens and
transformers'; an abort that lands while chunks are in flight frees the KV on every stage."""

import random

import pytest
import torch
from ring_utils import abort_with_chunks_in_flight, stage_kv_usage

from ringsched.engine import Engine
from ringsched.sampling.params import SamplingParams

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
KW = dict(kv_cache_memory="256M", log_level="warning", chunked_prefill_size=128)


def prompts() -> list[list[int]]:
    rng = random.Random(29)
    return [[rng.randrange(1000, 49152) for _ in range(n)] for n in (400, 900)]  # 4 and 8 chunks


def run(**kw) -> tuple[list[list[int]], dict]:
    with Engine(**{**KW, **kw}) as llm:
        outs = [o.token_ids for o in llm.generate(prompts(), GREEDY)]
        usage = stage_kv_usage(llm)
        stats = {r: dict(s) for r, s in llm.supervisor.stats.items()}
    assert set(usage.values()) == {0.0}, f"KV not freed on every stage: {usage}"
    return outs, stats


@pytest.fixture(scope="module")
def reference():
    return run(pp_size=1, threads_per_stage=2)[0]


@pytest.mark.parametrize(
    "layout",
    [dict(pp_size=2), dict(pp_size=3, pp_async_batch_depth=1, enable_dynamic_chunking=True)],
    ids=["pp2", "pp3-depth1-dynamic"],
)  # fmt: skip
def test_pipelined_chunks_give_pp1s_tokens(reference, layout):
    outs, stats = run(threads_per_stage=1, **layout)
    assert outs == reference
    # Every stage computed each prompt token once and each decode once: nothing repeated, nothing skipped.
    computed = sum(len(p) for p in prompts()) + len(prompts()) * (GREEDY.max_tokens - 1)
    assert {r: s["tokens"] for r, s in stats.items()} == dict.fromkeys(range(layout["pp_size"]), computed)


def test_long_prompts_match_transformers(reference, hf_smol):
    hf = hf_smol[0]
    for ids, ours in zip(prompts(), reference, strict=True):
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=GREEDY.max_tokens, do_sample=False,
                              min_new_tokens=GREEDY.max_tokens)  # fmt: skip
        assert out[0, len(ids):].tolist() == ours


def test_abort_with_chunks_in_flight_frees_every_stage():
    rng = random.Random(7)
    long = [rng.randrange(1000, 49152) for _ in range(3000)]
    after = prompts()[0][:300]
    with Engine(pp_size=2, pp_async_batch_depth=2, threads_per_stage=1, **{**KW, "chunked_prefill_size": 32}) as llm:
        expected = llm.generate([after], GREEDY)[0].token_ids
        abort_with_chunks_in_flight(llm, long, GREEDY, in_flight=3)  # its chunks fill the ring (4 slots)
        usage = stage_kv_usage(llm)
        assert usage == {0: 0.0, 1: 0.0}, f"KV not freed on every stage: {usage}"
        assert llm.generate([after], GREEDY)[0].token_ids == expected
