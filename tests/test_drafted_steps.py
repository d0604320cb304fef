"""Speculative drafts at each end of the ring, as plain data: stage 0's planner gives a decode its drafts (within
`max_tokens`, KV grown for them, never indexed in the prefix cache), keeps what comes back up to a finish and the KV
up to the last kept draft; the last stage's sampler bans stop ids per row under `min_tokens`, cuts drafts its grammar
refuses and pads what it keeps. (Whole rings with drafts: tests/test_loop_in_process.py.)"""

from __future__ import annotations

import torch

from ringsched.comm.messages import BatchPlan, NewRequest, PlanEntry
from ringsched.kv.cache import BlockTable
from ringsched.sampling.params import SamplingParams
from ringsched.scheduler.planner import Planner
from ringsched.scheduler.speculation import Speculator
from ringsched.speculative.config import SpeculativeConfig
from ringsched.speculative.verify import FILLER
from ringsched.stage.sampler_state import SamplerState

LOOP = [10, 11, 12, 13] * 5  # a prompt whose n-grams predict its own continuation


def planner(k=4, prefix=False):
    blocks = BlockTable(64, 4, prefix_caching=prefix)
    config = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2})
    return Planner(blocks, 4, 8, 64, eos_ids=(2,), max_len=4096, speculator=Speculator(config, blocks, 4096))


def add(p, rid, prompt, **kw):
    assert p.add(NewRequest(rid, list(prompt), SamplingParams(temperature=0, **kw).to_dict())) is None


def test_a_decode_gets_drafts_and_keeps_what_comes_back_with_its_kv():
    p = planner()
    add(p, "a", LOOP, max_tokens=20)
    p.plan(0, 0)
    p.on_output(0, [10])  # the prompt's next token
    plan = p.plan(1, 1)
    (e,) = plan.entries
    assert (e.start, e.token_ids, e.drafts) == (20, [10, 11, 12, 13, 10], 4)
    assert p.blocks.tables["a"] and len(p.blocks.tables["a"]) * 4 >= 25  # room for the drafted positions
    out = p.on_output(1, [11, 12, 99, FILLER, FILLER])  # two drafts kept, then the model's own token
    assert out[0].token_ids == [11, 12, 99]
    assert p.requests["a"].num_computed == 23  # KV of the last token and the two kept drafts
    (e,) = p.plan(0, 2).entries
    assert e.start == 23 and e.token_ids[0] == 99  # recomputes from the first unkept position
    assert p.speculator.stats() == {"spec_draft_tokens": 4, "spec_accepted_tokens": 2, "spec_verify_steps": 1}


def test_drafts_stay_within_max_tokens_and_a_finish_among_the_kept_tokens_cuts_them():
    p = planner()
    add(p, "a", LOOP, max_tokens=3)
    p.plan(0, 0)
    p.on_output(0, [10])
    (e,) = p.plan(1, 1).entries
    assert e.drafts == 1  # one output so far: a draft and its bonus token make 3
    p2 = planner()
    add(p2, "b", LOOP, max_tokens=20)
    p2.plan(0, 0)
    p2.on_output(0, [10])
    p2.plan(1, 1)
    out = p2.on_output(1, [11, 2, 12, 13, 10])  # EOS as the second kept token
    assert out[0].token_ids == [11, 2] and out[0].finish_reason == "stop"


def test_drafts_are_not_indexed_in_the_prefix_cache():
    p = planner(prefix=True)
    add(p, "a", LOOP[:7], max_tokens=20)  # 7 prompt tokens, then one output: two full blocks of 4 known
    p.plan(0, 0)
    p.on_output(0, [13])
    (e,) = p.plan(1, 1).entries
    assert e.drafts >= 1 and e.start + len(e.token_ids) > 8  # the drafts reach into the third block
    assert len(p.blocks.cache.block_of) == 2  # blocks [0, 4) and [4, 8) only: a draft is not a known token


def sampler_with(rid, params, prompt):
    state = SamplerState(torch.device("cpu"), eos_ids=(2,))
    state.apply(BatchPlan(0, 0, entries=[PlanEntry(rid, 0, list(prompt), True)],
                          announce=[NewRequest(rid, [], params.to_dict(), len(prompt))]))  # fmt: skip
    return state


def test_min_tokens_bans_stop_ids_per_drafted_row():
    """Row j samples output token n + j: under min_tokens=2 rows 0 and 1 may not draw EOS, row 2 may."""
    params = SamplingParams(temperature=0, min_tokens=2)
    state = sampler_with("a", params, [5, 6, 7])
    logits = torch.zeros(3, 16)
    logits[:, 2] = 10.0  # EOS everywhere the likeliest
    logits[0, 8], logits[1, 9] = 5.0, 5.0  # the runners-up of rows 0 and 1
    plan = BatchPlan(0, 1, entries=[PlanEntry("a", 2, [7, 8, 9], True, drafts=2)])
    state.apply(plan)
    targets, packed = state.sample(plan, logits)
    assert targets.tolist() == [8, 9, 2] and packed.tolist() == [8, 9, 2]  # both drafts kept, then EOS
    plan2 = BatchPlan(0, 2, entries=[PlanEntry("a", 2, [7, 9, 9], True, drafts=2)])  # the first draft is wrong
    state.apply(plan2)
    assert state.sample(plan2, logits)[1].tolist() == [8, FILLER, FILLER]
