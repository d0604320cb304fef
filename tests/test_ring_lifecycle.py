"""Aborts, preemption and stage death on the real ring (PP=2, gloo, SmolLM2)."""

import os
import signal
import time

import pytest
from ring_utils import children_of, run_staggered, stage_kv_usage

from ringsched.engine import Engine
from ringsched.process.supervisor import StageFailure
from ringsched.sampling.params import SamplingParams

pytestmark = pytest.mark.slow  # real model or several processes: the full suite's

KW = dict(threads_per_stage=1, log_level="warning")


def prompts(n: int, length: int, start: int = 1000) -> list[list[int]]:
    return [[start + 37 * i + j for j in range(length)] for i in range(n)]


def collect(llm: Engine, rids: set[str], timeout: float = 120.0) -> dict[str, tuple[list[int], str]]:
    got = {r: [] for r in rids}
    done: dict[str, tuple[list[int], str]] = {}
    deadline = time.monotonic() + timeout
    while len(done) < len(rids):
        assert time.monotonic() < deadline, f"{len(rids) - len(done)} requests never ended"
        for o in llm.poll(0.05):
            if o.rid in got:
                got[o.rid] += o.token_ids
                if o.finish_reason:
                    done[o.rid] = (got[o.rid], o.finish_reason)
    return done


def test_abort_anywhere_frees_kv_on_every_stage():
    decode_params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    with Engine(pp_size=2, pp_async_batch_depth=1, max_running_requests=6, chunked_prefill_size=48,
                kv_cache_memory="128M", **KW) as llm:
        decoders = [llm.submit(p, decode_params) for p in prompts(4, 8)]
        long_prefill = llm.submit(prompts(1, 590, start=5000)[0], decode_params)
        survivors = [llm.submit(p, SamplingParams(max_tokens=40, temperature=0.0)) for p in prompts(1, 20, 9000)]
        waiting = llm.submit(prompts(1, 10, 7000)[0], decode_params)  # 7th: over max_running, so it waits
        events: dict[str, list[int]] = {r: [] for r in decoders + survivors + [long_prefill, waiting]}
        llm.abort(waiting)
        aborted = {waiting}
        ends: dict[str, str] = {}
        deadline = time.monotonic() + 120
        while len(ends) < len(events):
            assert time.monotonic() < deadline, "requests never ended"
            for o in llm.poll(0.02):
                events[o.rid] += o.token_ids
                if o.finish_reason:
                    ends[o.rid] = o.finish_reason
            # Mid-prefill: the 590-token prompt takes >12 chunks of 48; abort it once decodes are flowing.
            if long_prefill not in aborted and len(events[decoders[0]]) >= 2:
                assert not events[long_prefill], "the long prompt finished prefill before the abort"
                llm.abort(long_prefill)
                aborted.add(long_prefill)
            # Mid-decode, at different points (so in different slots): after 5 and after 9 tokens.
            for r, at in ((decoders[0], 5), (decoders[1], 9)):
                if r not in aborted and len(events[r]) >= at:
                    llm.abort(r)
                    aborted.add(r)
        assert {r: ends[r] for r in aborted} == {r: "abort" for r in aborted}
        for r in set(events) - aborted:
            assert ends[r] in ("length", "stop")
        assert len(events[decoders[0]]) < 64 and len(events[decoders[1]]) < 64
        usage = stage_kv_usage(llm)
        assert usage == {0: 0.0, 1: 0.0}, usage
        # Stage 0 reports to the supervisor and to the front end separately: wait for the front end's copy.
        stats = llm.wait_idle()
        assert stats["running"] == 0 and stats["waiting"] == 0, stats
        # The others finished unchanged: the same requests alone give the same tokens.
        alone = llm.generate([prompts(4, 8)[2], prompts(4, 8)[3]], decode_params)
        assert [a.token_ids for a in alone] == [events[decoders[2]], events[decoders[3]]]
        alone = llm.generate(prompts(1, 20, 9000), SamplingParams(max_tokens=40, temperature=0.0))
        assert alone[0].token_ids == events[survivors[0]]


def test_small_pool_preempts_and_recomputes():
    work = [(p, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)) for p in prompts(8, 48)]
    with Engine(pp_size=1, kv_cache_memory="64M", **KW) as llm:
        expected = run_staggered(llm, work, gap=0.0)
        assert llm.wait_idle()["preemptions"] == 0
    # 8 x 72 tokens need ~580 tokens of KV; the pool below holds 400 per stage.
    with Engine(pp_size=2, kv_cache_memory=str(400 * 15 * 1536), **KW) as llm:
        got = run_staggered(llm, work, gap=0.0)
        stats = llm.wait_idle()
        assert stats["preemptions"] > 0, "the pool was big enough: the test did not exercise preemption"
        assert stage_kv_usage(llm) == {0: 0.0, 1: 0.0}
    assert got == expected


def test_killed_stage_stops_everything_with_max_restarts_0():
    llm = Engine(pp_size=2, kv_cache_memory="64M", max_restarts=0, **KW)
    try:
        victim = llm.supervisor.procs[1]
        llm.submit(prompts(1, 16)[0], SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True))
        llm.poll(1.0)
        os.kill(victim.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(StageFailure, match="stage 1"):
            while time.monotonic() - start < 10:
                llm.poll(0.1)
        assert time.monotonic() - start < 10
    finally:
        llm.shutdown()
    gone_by = time.monotonic() + 10
    while children_of(os.getpid()) and time.monotonic() < gone_by:
        time.sleep(0.1)
    assert not children_of(os.getpid()), "a child process outlived the engine"
