"""Replayed requests on a real ring (issue 47), tiny random model, PP=1 and PP=2: a fresh engine given a request's
prompt, its params as the front end first sent them (the seed included) and its first k delivered tokens goes on
with exactly the tokens k.. of the undisturbed run (greedy, seeded and unseeded sampling, penalties, min_tokens,
a grammar, log-probabilities), and `Engine.replay_open` resubmits the open requests of a ring that lost them."""

from __future__ import annotations

import dataclasses

import pytest

from ringsched.comm.messages import AbortRequest, NewRequest, TokenOutput
from ringsched.engine import Engine
from ringsched.sampling import structured
from ringsched.sampling.params import SamplingParams

pytestmark = pytest.mark.slow  # several processes

N = 12
PROMPTS = [[5, 6, 7, 8], [9, 8, 7], [3, 1, 4, 1, 5], [42, 7, 1, 8], [11, 12], [13, 14, 15], [21, 22]]
PARAMS = [
    SamplingParams(max_tokens=N, temperature=0, ignore_eos=True),
    SamplingParams(max_tokens=N, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True),
    SamplingParams(max_tokens=N, temperature=0.8, seed=3, frequency_penalty=0.5, presence_penalty=0.3,
                   repetition_penalty=1.2, ignore_eos=True),  # fmt: skip
    SamplingParams(max_tokens=N, temperature=0, repetition_penalty=1.3, logprobs=2, ignore_eos=True),
    SamplingParams(max_tokens=N, temperature=1.0, ignore_eos=True),  # unseeded: the front end seeds it
    SamplingParams(max_tokens=N, temperature=1.0, min_tokens=N - 2, top_k=3),  # may stop at EOS after min_tokens
    # a grammar whose next token depends on the delivered ones: a fresh matcher must first consume them
    SamplingParams(max_tokens=N, temperature=0, ignore_eos=True, grammar=structured.grammar_for(regex="([a-z][0-9])+")),
]


def engine(model_dir, pp: int) -> Engine:
    return Engine(model=str(model_dir), pp_size=pp, threads_per_stage=1, kv_cache_memory="16M",
                  log_level="warning")  # fmt: skip


def collect(llm: Engine, rids: set[str]) -> dict[str, list[TokenOutput]]:
    """Every output of `rids` until each has finished."""
    outs: dict[str, list[TokenOutput]] = {rid: [] for rid in rids}
    pending = set(rids)
    while pending:
        for o in llm.poll(0.2):
            if o.rid in outs:
                outs[o.rid].append(o)
                if o.finish_reason:
                    pending.discard(o.rid)
    return outs


def tokens(outs: list[TokenOutput]) -> list[int]:
    return [t for o in outs for t in o.token_ids]


def logprobs(outs: list[TokenOutput]) -> list:
    return [lp for o in outs for lp in (o.logprobs or [])]


@pytest.mark.parametrize("pp", [1, 2])
def test_a_replay_on_a_fresh_engine_goes_on_with_the_undisturbed_tokens(tiny_llama_dir, pp):
    with engine(tiny_llama_dir, pp) as first:
        sent: list[NewRequest] = []
        send = first.link.send
        first.link.send = lambda m: (sent.append(m), send(m))[1]  # what the front end sent, seeds included
        rids = [first.submit(p, sp) for p, sp in zip(PROMPTS, PARAMS, strict=True)]
        whole = collect(first, set(rids))
    assert SamplingParams.from_dict(sent[4].params).seed is not None  # the front end seeded it
    assert len(set(map(tuple, (tokens(whole[r]) for r in rids)))) > 3  # it really generated different texts
    with engine(tiny_llama_dir, pp) as fresh:
        expect, replays = {}, []
        for new in sent:
            full = tokens(whole[new.rid])
            for k in sorted({1, len(full) // 2}):
                if k >= len(full):
                    continue
                rid = f"{new.rid}-k{k}"
                replays.append(NewRequest(rid, new.token_ids, new.params, output_ids=full[:k]))
                expect[rid] = (new.rid, k)
        for new in replays:
            fresh.link.send(new)
        got = collect(fresh, set(expect))
    for rid, (orig, k) in expect.items():
        undisturbed, replayed = whole[orig], got[rid]
        assert tokens(replayed) == tokens(undisturbed)[k:], rid
        assert replayed[-1].finish_reason == undisturbed[-1].finish_reason, rid
        assert replayed[-1].completion_tokens == undisturbed[-1].completion_tokens, rid
        assert replayed[-1].prompt_tokens == undisturbed[-1].prompt_tokens, rid
        lps, want = logprobs(replayed), logprobs(undisturbed)[k:]
        assert len(lps) == len(want), rid
        for (lp, top), (wlp, wtop) in zip(lps, want, strict=True):
            assert lp == pytest.approx(wlp, abs=1e-4) and [t[0] for t in top] == [t[0] for t in wtop], rid


def _forget_behind_its_back(llm: Engine, rids: list[str]) -> None:
    """Make stage 0 drop `rids` while the engine still holds them open (what a replaced stage 0 does): aborts sent
    on the link, their answers read off the link (never by the engine), until stage 0 is idle."""
    for rid in rids:
        llm.link.send(AbortRequest(rid))
    while True:
        msg = llm.link.recv(timeout_ms=200)
        s = msg.stats if msg is not None else None
        if s and s["running"] == 0 and s["waiting"] == 0 and s["kv_usage"] == 0:
            return


def test_replay_open_resubmits_what_a_ring_lost_and_each_goes_on(tiny_llama_dir):
    long = [dataclasses.replace(p, max_tokens=400, min_tokens=0, ignore_eos=True) for p in PARAMS[:4]]
    with engine(tiny_llama_dir, 2) as llm:
        reference = [o.token_ids for o in llm.generate(PROMPTS[:4], long)]
        rids = [llm.submit(p, sp) for p, sp in zip(PROMPTS[:4], long, strict=True)]
        seen: dict[str, list[int]] = {rid: [] for rid in rids}
        while not all(seen.values()):
            for o in llm.poll(0.05):
                seen[o.rid] += o.token_ids
        open_now = [rid for rid in rids if rid in llm.open_requests.open]
        assert open_now  # 400 tokens each: still running
        _forget_behind_its_back(llm, rids)
        assert llm.replay_open() == len(open_now) and llm.requests_replayed == len(open_now)
        rest = collect(llm, set(open_now))
    for rid, ref in zip(rids, reference, strict=True):
        if rid in rest:
            seen[rid] += tokens(rest[rid])
        assert seen[rid] == ref, rid

