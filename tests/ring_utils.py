"""Helpers for ring tests: a reproducible mixed workload, staggered submission, and child-process checks."""

from __future__ import annotations

import math
import random
import time

import psutil

from ringsched.engine import Engine
from ringsched.sampling.params import SamplingParams


def mixed_workload(n: int, seed: int = 0, max_prompt: int = 600, max_new: int = 200, vocab: int = 49152,
                   longest: int | None = None):
    """`n` (prompt ids, params) pairs: prompts of 1..max_prompt tokens and one of `longest` (default max_prompt),
    1..max_new new tokens, greedy.

    Lengths are log-uniform (many short, a few long, both extremes present) so that the whole range is
    covered at a CPU cost the test suite can afford."""
    rng = random.Random(seed)

    def logu(hi: int) -> int:
        return min(hi, max(1, round(math.exp(rng.uniform(0, math.log(hi))))))

    lengths = [1, longest or max_prompt] + [logu(max_prompt) for _ in range(n - 2)]
    news = [max_new, 1] + [logu(max_new) for _ in range(n - 2)]
    out = []
    for plen, new in zip(lengths, news, strict=True):
        ids = [rng.randrange(100, vocab) for _ in range(plen)]
        out.append((ids, SamplingParams(max_tokens=new, temperature=0.0)))
    return out


def run_staggered(llm: Engine, work, gap: float = 0.01, timeout: float = 600.0) -> list[list[int]]:
    """Submit one request every `gap` seconds while collecting outputs; generated ids per request."""
    rids: list[str] = []
    got: dict[str, list[int]] = {}
    done: dict[str, str] = {}
    deadline = time.monotonic() + timeout
    nxt = time.monotonic()
    while len(done) < len(work):
        assert time.monotonic() < deadline, f"only {len(done)}/{len(work)} requests finished"
        while len(rids) < len(work) and time.monotonic() >= nxt:
            ids, params = work[len(rids)]
            rid = llm.submit(ids, params)
            rids.append(rid)
            got[rid] = []
            nxt += gap
        for o in llm.poll(0.01):
            got[o.rid] += o.token_ids
            if o.finish_reason:
                assert o.finish_reason in ("stop", "length"), (o.finish_reason, o.error)
                done[o.rid] = o.finish_reason
    return [got[r] for r in rids]


def children_of(pid: int) -> list[psutil.Process]:
    """Live child processes, without multiprocessing's resource tracker (it lives as long as the
    interpreter that spawned anything, by design)."""
    try:
        kids = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    out = []
    for k in kids:
        try:
            if k.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in " ".join(k.cmdline()):
                out.append(k)
        except psutil.NoSuchProcess:
            pass
    return out


def stage_kv_usage(llm: Engine, timeout: float = 10.0) -> dict[int, float]:
    """Wait until every stage has reported a KV usage of zero (or the timeout); the last reports."""
    deadline = time.monotonic() + timeout
    while True:
        llm.poll(0.1)
        usage = {r: s["kv_usage"] for r, s in llm.supervisor.stats.items()}
        if (len(usage) == llm.cfg.world_size and all(u == 0 for u in usage.values())) or time.monotonic() > deadline:
            return usage


def abort_with_chunks_in_flight(llm: Engine, long: list[int], params: SamplingParams, in_flight: int,
                                timeout: float = 60.0) -> None:  # fmt: skip
    """Submit the long prompt, abort it once stage 0 reports it in at least `in_flight` in-flight micro-batches,
    and check that the abort is its end, with no token (the KV checks are the caller's)."""
    rid = llm.submit(long, params)
    deadline = time.monotonic() + timeout
    while llm.last_stats.get("request_in_flight_max", 0) < in_flight:
        assert time.monotonic() < deadline, f"the prompt's chunks never filled the ring: {llm.last_stats}"
        assert not [o for o in llm.poll(0.05) if o.rid == rid], "the long prompt finished before the abort"
    llm.abort(rid)
    ends = []
    while not ends:
        assert time.monotonic() < deadline, "no answer to the abort"
        ends = [o for o in llm.poll(0.1) if o.rid == rid and o.finish_reason]
    assert ends[0].finish_reason == "abort" and ends[0].completion_tokens == 0
