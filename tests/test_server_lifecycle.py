"""The server's ends: a burst beyond running plus queued and a full waiting queue (503), SIGTERM under load, and
a stage that dies mid-stream.

Each test starts its own real server (SmolLM2, two stages) because each one ends it.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import time

import httpx
import pytest
from sse import read_sse

from ringsched.bench.server_process import ServerProcess

pytestmark = pytest.mark.slow

BASE = ["--pp-size", "2", "--threads-per-stage", "1", "--kv-cache-memory", "64M", "--max-model-len", "1024"]


def finish_reason(result: dict) -> str | None:
    reasons = [c["choices"][0]["finish_reason"] for c in result["chunks"] if c["choices"]]
    return reasons[-1] if reasons else None


def wait_exit(srv: ServerProcess, timeout: float) -> int | None:
    try:
        return srv.proc.wait(timeout)
    except Exception:
        return None


def assert_tree_gone(srv: ServerProcess, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while srv.leftovers() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert srv.leftovers() == [], [p.cmdline() for p in srv.leftovers()]


def waiting(srv: ServerProcess) -> float:
    text = httpx.get(f"{srv.url}/metrics", timeout=10).text
    m = re.search(r"^ringsched:num_requests_waiting ([0-9.]+)$", text, re.M)
    return float(m.group(1)) if m else -1


def burst_beyond_running_plus_queued(srv: ServerProcess, count: int, places: int) -> None:
    """`count` requests at once at a server taking `places` (running plus queued): the rest get 503, each accepted
    one completes, and no request is left open."""
    url = f"{srv.url}/v1/completions"
    body = {"max_tokens": 16, "ignore_eos": True, "temperature": 0}

    async def one(hc: httpx.AsyncClient, i: int) -> tuple[httpx.Response, float]:
        r = await hc.post(url, json={**body, "prompt": f"Request {i}:"})
        return r, time.monotonic()

    async def burst() -> list[tuple[httpx.Response, float]]:
        async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=400)) as hc:
            return await asyncio.gather(*(one(hc, i) for i in range(count)))

    results = asyncio.run(burst())
    refused = [(r, t) for r, t in results if r.status_code == 503]
    accepted = [(r, t) for r, t in results if r.status_code != 503]
    for r, _ in refused:
        assert r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "queue_full", r.text
    for r, _ in accepted:
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16, r.text
    # The first `places` are always taken; each one that finished before the last refusal freed one place.
    last_refusal = max(t for _, t in refused)
    early = sum(t < last_refusal for _, t in accepted)
    assert count - places - early <= len(refused) <= count - places
    m = httpx.get(f"{srv.url}/metrics", timeout=10).text
    assert re.search(r"^ringsched:num_requests_open 0\.0$", m, re.M), m


def test_burst_and_a_full_queue_get_503_then_sigterm_drains_and_exits():
    """One server (2 running, 2 queued): a burst of 60 requests beyond its places, then a full queue under
    load and SIGTERM."""
    args = [*BASE, "--max-running-requests", "2", "--max-queued-requests", "2", "--shutdown-timeout", "3"]
    with ServerProcess(args) as srv:
        burst_beyond_running_plus_queued(srv, 60, 2 + 2)
        url = f"{srv.url}/v1/completions"
        body = {"prompt": "Once upon a time", "ignore_eos": True, "temperature": 0}

        async def scenario() -> tuple[list[dict], float]:
            async with httpx.AsyncClient(timeout=60) as hc:
                # Two run (one short enough to finish while draining, long enough to outlast the queue's filling
                # on a loaded host: when it finished first, a waiting request took its place and the queue had
                # room), then two wait behind them.
                firsts = [asyncio.Event() for _ in range(4)]
                lengths = [40, 400, 400, 400]
                tasks = [
                    asyncio.create_task(read_sse(hc, url, {**body, "max_tokens": n}, ev))
                    for n, ev in zip(lengths[:2], firsts, strict=False)
                ]
                await asyncio.wait_for(asyncio.gather(firsts[0].wait(), firsts[1].wait()), 60)
                tasks += [asyncio.create_task(read_sse(hc, url, {**body, "max_tokens": n})) for n in lengths[2:]]
                deadline = time.monotonic() + 10
                while waiting(srv) < 2 and time.monotonic() < deadline:
                    await asyncio.sleep(0.1)
                assert not tasks[0].done(), "the short request finished before the queue filled"
                r = await hc.post(url, json={**body, "max_tokens": 4})
                assert r.status_code == 503, r.text
                assert r.headers["retry-after"] == "1"
                assert r.json()["error"]["code"] == "queue_full"
                assert (await hc.get(f"{srv.url}/v1/models")).status_code == 200  # still answering

                srv.descendants()  # remember the whole tree before it goes
                os.kill(srv.proc.pid, signal.SIGTERM)
                t0 = time.monotonic()
                results = await asyncio.wait_for(asyncio.gather(*tasks), 30)
                return results, t0

        results, t0 = asyncio.run(scenario())
        for r in results:
            assert r["done"], r
            assert (finish_reason(r) in ("length", "stop")) != (r["error"] is not None), r
        errors = [r["error"] for r in results if r["error"]]
        assert errors and all("shutting down" in e["message"] for e in errors)
        code = wait_exit(srv, 3 + 15)
        assert code == 0, srv.log()[-3000:]
        # Nothing of the server's process group outlives it, not even for a moment (multiprocessing's tracker).
        group = subprocess.run(["pgrep", "-a", "-g", str(srv.proc.pid)], capture_output=True, text=True).stdout
        assert group == "", group
        assert time.monotonic() - t0 < 3 + 15
        assert_tree_gone(srv)
        assert "every stage process has exited" in srv.log()


def test_stage_death_ends_streams_with_an_error_with_max_restarts_0():
    with ServerProcess([*BASE, "--max-restarts", "0"]) as srv:
        url = f"{srv.url}/v1/completions"
        body = {"prompt": "Once upon a time", "ignore_eos": True, "max_tokens": 500}

        async def scenario() -> list[dict]:
            async with httpx.AsyncClient(timeout=15) as hc:  # a stream silent for 15 s fails the test: no hangs
                firsts = [asyncio.Event() for _ in range(3)]
                tasks = [asyncio.create_task(read_sse(hc, url, body, ev)) for ev in firsts]
                await asyncio.wait_for(asyncio.gather(*(ev.wait() for ev in firsts)), 60)
                srv.descendants()
                os.kill(srv.stage_pid(1), signal.SIGKILL)
                return await asyncio.wait_for(asyncio.gather(*tasks), 15)

        t0 = time.monotonic()
        results = asyncio.run(scenario())
        for r in results:
            assert r["done"] and r["error"] is not None, r
            assert "stage" in r["error"]["message"]
        unhealthy = False
        while time.monotonic() - t0 < 10 and not unhealthy:
            try:
                unhealthy = httpx.get(f"{srv.url}/health", timeout=2).status_code == 503
            except httpx.HTTPError:
                unhealthy = srv.proc.poll() is not None
            time.sleep(0.1)
        assert unhealthy or srv.proc.poll() is not None
        assert wait_exit(srv, 20) == 1, srv.log()[-3000:]
        assert_tree_gone(srv)
        log = srv.log()
        assert "the engine failed" in log and re.search(r"stage ?1", log), log[-3000:]


@pytest.mark.parametrize(("busy", "tp"), [(False, 1), (True, 2)], ids=["idle", "busy-tp2"])
def test_a_stopped_stage_is_noticed_by_its_heartbeat(busy, tp):
    """SIGSTOP of stage 1 (at TP=2, of its second rank: global rank 3), idle or while three streams run: each
    stream ends with an error naming it hung. (Busy at TP=1 is the same check of the same heartbeat.)"""
    timeout = 3.0
    name, victim = ("ringsched-pp1", "stage 1") if tp == 1 else ("ringsched-pp1t1", "rank 3 (stage 1, tp 1)")
    flags = ["--tp-size", str(tp), "--heartbeat-timeout", str(timeout), "--max-restarts", "0"]
    with ServerProcess([*BASE, *flags]) as srv:
        pids = subprocess.run(["pgrep", "-x", name], capture_output=True, text=True).stdout.split()
        stage1 = srv.stage_pid(1, tp=1 if tp > 1 else None)
        assert str(stage1) in pids  # each rank is findable by name
        url = f"{srv.url}/v1/completions"
        body = {"prompt": "Once upon a time", "ignore_eos": True, "max_tokens": 900}

        async def scenario() -> tuple[list[dict], float]:
            async with httpx.AsyncClient(timeout=timeout + 10) as hc:
                firsts = [asyncio.Event() for _ in range(3 if busy else 0)]
                tasks = [asyncio.create_task(read_sse(hc, url, body, ev)) for ev in firsts]
                await asyncio.wait_for(asyncio.gather(*(ev.wait() for ev in firsts)), 60)
                srv.descendants()
                os.kill(stage1, signal.SIGSTOP)
                t0 = time.monotonic()
                return await asyncio.wait_for(asyncio.gather(*tasks), timeout + 10), t0

        results, t0 = asyncio.run(scenario())
        for r in results:
            assert r["done"] and r["error"] is not None, r
            assert r["error"]["code"] == "engine_failed" and victim in r["error"]["message"], r
            assert "hung" in r["error"]["message"]
        code = wait_exit(srv, timeout + 5 - (time.monotonic() - t0))
        assert code == 1, srv.log()[-3000:]
        assert time.monotonic() - t0 < timeout + 5
        assert_tree_gone(srv)
        assert re.search(rf"{re.escape(victim)} \(pid \d+\) is hung: no heartbeat", srv.log()), srv.log()[-3000:]


def test_sigterm_right_after_the_first_health_200_exits_cleanly():
    """SIGTERM as soon as /health answers 200 (the server may not have logged that it serves yet): exit 0, no
    traceback, no process left (it used to read the closed socket's address and fail with EBADF)."""
    srv = ServerProcess(["--threads-per-stage", "1", "--kv-cache-memory", "16M", "--max-model-len", "256"])
    srv.start()  # returns at the first 200 of /health
    try:
        assert srv.stop() == 0, srv.log()
        assert "Traceback" not in srv.log(), srv.log()
    finally:
        srv.stop(grace=0)
    assert_tree_gone(srv)
