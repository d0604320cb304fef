"""The ring end to end: real stage processes, real ZMQ, real gloo, the real SmolLM2.

Greedy output must be identical for every pp size and async depth (invariant 6), with the prefix cache on and
off, equal to transformers on a subset, and seeded sampling must not depend on the pp size.
"""

import os

import pytest
import torch
from ring_utils import children_of, mixed_workload, run_staggered, stage_kv_usage

from ringsched.engine import Engine
from ringsched.layout.partition import default_partition, head_layers
from ringsched.sampling.params import SamplingParams
from ringsched.weights.model_config import ModelConfig

pytestmark = pytest.mark.slow  # real model or several processes: the full suite's

ENGINE_KW = dict(threads_per_stage=1, kv_cache_memory="256M", log_level="warning")


GREEDY = 32  # greedy requests in the workload, then 8 seeded ones
# A request's tokens do not depend on its companions: a third of the greedy requests and every seeded one.
PICKED = [*range(0, GREEDY, 3), *range(GREEDY, GREEDY + 8)]


def workload():
    # Prompts of 1 to 300 tokens and one of 600 (prefill is most of the CPU time the tests here spend).
    greedy = mixed_workload(GREEDY, seed=0, max_prompt=300, longest=600, max_new=100)
    # A third of the prompts open with a shared head of 40 to 72 tokens (their lengths unchanged): with the prefix
    # cache on (the default, off at CP), later ones start from earlier ones' blocks, mid-flight or finished.
    head = [100 + 7 * j for j in range(72)]
    for i in range(2, GREEDY, 3):
        ids, _ = greedy[i]
        k = min(len(ids) - 1, 40 + 8 * (i % 5))
        ids[:k] = head[:k]
    rng = torch.Generator().manual_seed(1)
    seeded = []
    for i in range(8):
        ids = torch.randint(100, 40000, (int(torch.randint(4, 64, (1,), generator=rng)),), generator=rng).tolist()
        seeded.append((ids, SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, top_k=50, seed=100 + i)))
    return greedy + seeded


def run(pp: int, depth: int, picked: list[int] | None = None, **kw) -> tuple[list[list[int]], dict]:
    """The workload (its `picked` requests, else all) at `pp` x `depth`: each request's tokens, and the stats."""
    work = workload()
    with Engine(pp_size=pp, pp_async_batch_depth=depth, **ENGINE_KW, **kw) as llm:
        outs = run_staggered(llm, work if picked is None else [work[i] for i in picked])
        usage = stage_kv_usage(llm)
        pids = [p.pid for p in llm.supervisor.procs]
        stats = {**llm.supervisor.stats, "sched": llm.wait_idle()}
    assert usage == {r: 0.0 for r in range(pp)}, f"KV not freed on every stage: {usage}"
    for pid in pids:
        assert not any(c.pid == pid for c in children_of(os.getpid())), "a stage outlived the engine"
    return outs, stats


SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "adaptive": False}


@pytest.fixture(scope="module")
def reference():
    """PP=1 without the prefix cache: every other layout runs with it (but CP) and must give these tokens."""
    outs, stats = run(1, 0, enable_prefix_caching=False)
    assert "prefix_cache_hits" not in stats["sched"]
    return outs


# Every pp size and every depth appears (depth 1 in the flexible-cut test below); the full 2x3 product costs ~7
# minutes of CPU on two cores, so it runs when RINGSCHED_FULL_MATRIX=1. PP=2 at depth 0 runs with the cut decided
# while running (`--pp-flex-policy ready`: stage 0 cuts each micro-batch when stage 1 is (about to be) ready, stage 1
# reads the cut from the K/V rows it receives) and prompts in 48-token chunks, so that a prompt's chunks go around
# together with the cut moving (each cut no later than the chunk before it while that one is in flight); PP=3 with
# the fixed cut. (PP=2's fixed cut: test_long_prompts.py, test_prefix_cache_ring.py, test_ring_lifecycle.py.)
READY = dict(pp_flex_layers=2, pp_flex_policy="ready", chunked_prefill_size=48)
COMBOS = [(2, 0, READY), (3, 2, {})]
if os.environ.get("RINGSCHED_FULL_MATRIX") == "1":
    COMBOS = [(2, 0, READY), (2, 0, {}), (2, 1, {}), (2, 2, {}), (3, 0, {}), (3, 1, {}), (3, 2, {})]


def _combo_id(v):
    return ("ready" if v == READY else "fixed") if isinstance(v, dict) else None


@pytest.mark.parametrize("pp,depth,kw", COMBOS, ids=_combo_id)
def test_identical_across_pp_and_depth(reference, smollm2_dir, pp, depth, kw):
    outs, stats = run(pp, depth, **kw)
    assert stats["sched"]["prefix_cache_hits"] >= 5 * 32  # the shared heads were found cached
    if kw:
        assert stats["sched"]["pipelined_chunks"] >= 4, "no prompt had two chunks in flight"
        cuts = {int(c) for c in stats[0]["flex_cuts"]}
        assert len(cuts) > 1 and cuts <= flex_cuts(smollm2_dir, 2), cuts
    mismatched = [i for i, (a, b) in enumerate(zip(outs, reference, strict=True)) if a != b]
    assert not mismatched, f"requests {mismatched} differ from PP=1 at pp={pp} depth={depth} {kw}"


def test_context_parallel_ranks_give_the_same_tokens_through_preemption(reference):
    """`--cp-size 2` with a pool of 448 tokens per rank, less than the requests running at once hold: greedy and
    seeded requests give PP=1's tokens while preemption recomputes requests, and every rank frees its KV. With
    speculative drafts, placed over the ranks like any chunk and dropped where rejected. (A request that fits only
    spread over both ranks: `test_cp_engine.py`.)"""
    kw = {**ENGINE_KW, "kv_cache_memory": str(448 * 30 * 1536), "speculative_config": SPEC}
    work = workload()
    with Engine(cp_size=2, **kw) as llm:
        outs = run_staggered(llm, [work[i] for i in PICKED], gap=0.0)
        stats = llm.wait_idle()
        usage = stage_kv_usage(llm)
    assert stats["preemptions"] > 0, "the pool was big enough: the test did not exercise preemption"
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"], stats
    assert usage == {0: 0.0, 1: 0.0}, f"KV not freed on every rank: {usage}"
    mismatched = [i for i, out in zip(PICKED, outs, strict=True) if out != reference[i]]
    assert not mismatched, f"requests {mismatched} differ from PP=1 at CP=2"


def flex_cuts(smollm2_dir, flex: int) -> set[int]:
    """The cuts `--pp-flex-layers flex` allows around SmolLM2's default two-stage split."""
    cfg = ModelConfig.from_dir(smollm2_dir)
    first = default_partition(cfg.num_layers, 2, head_layers(cfg))[0]
    return set(range(first - flex, first + flex + 1))


def test_flexible_cut_gives_the_same_tokens(reference, smollm2_dir):
    """`--pp-flex-layers`: every micro-batch cut somewhere else (cycle), the shared layers' K/V mirrored both
    ways, with speculative drafts and prompts in 48-token chunks (a prompt's chunks go around together with the cut
    moving); the tokens are PP=1's and the KV is freed on both stages (checked in `run`)."""
    outs, stats = run(2, 1, pp_flex_layers=2, pp_flex_policy="cycle", speculative_config=SPEC, chunked_prefill_size=48)
    assert 0 < stats["sched"]["spec_accepted_tokens"] < stats["sched"]["spec_draft_tokens"], stats["sched"]
    assert stats["sched"]["pipelined_chunks"] >= 4, "no prompt had two chunks in flight"
    cuts = {int(c): n for c, n in stats[0]["flex_cuts"].items()}
    assert set(cuts) == flex_cuts(smollm2_dir, 2) and min(cuts.values()) > 10, cuts
    mismatched = [i for i, (a, b) in enumerate(zip(outs, reference, strict=True)) if a != b]
    assert not mismatched, f"requests {mismatched} differ from PP=1 with a moving cut"


def test_lengths_and_variety(reference):
    work = workload()
    for (_ids, params), out in zip(work, reference, strict=True):
        assert 1 <= len(out) <= params.max_tokens
    assert max(len(ids) for ids, _ in work) == 600 and min(len(ids) for ids, _ in work) == 1
    assert len({tuple(o) for o in reference}) > GREEDY  # not one answer for everything


def test_greedy_matches_transformers_subset(reference, hf_smol):
    hf = hf_smol[0]
    work = workload()
    # A spread of prompt lengths, including the 600-token one and the longest generation.
    subset = [0, 1] + sorted(range(2, GREEDY), key=lambda i: len(work[i][0]))[::10]
    for i in subset:
        ids, params = work[i]
        out = hf(torch.tensor([ids]), use_cache=True)
        toks = []
        with torch.no_grad():
            while len(toks) < params.max_tokens:
                nxt = int(out.logits[0, -1].argmax())
                toks.append(nxt)
                if nxt == 2:  # <|im_end|>, SmolLM2's EOS
                    break
                out = hf(torch.tensor([[nxt]]), past_key_values=out.past_key_values, use_cache=True)
        assert reference[i] == toks, f"request {i} ({len(ids)} prompt tokens) differs from transformers"
