"""A failed rank replaced (`--max-restarts`): the real ring (gloo, ZMQ, spawned stages) of a tiny random model loses
a rank to SIGKILL or SIGSTOP, the supervisor replaces it, the others rejoin, and the ring answers as before; beyond
the limit the engine stops as it always did."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time

import httpx
import openai
import pytest
from ring_utils import children_of

from ringsched.bench.server_process import ServerProcess
from ringsched.engine import Engine
from ringsched.process.supervisor import StageFailure
from ringsched.sampling.params import SamplingParams

pytestmark = pytest.mark.slow  # several processes each

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=8, temperature=0.9, seed=7, ignore_eos=True)
PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10, 11]]


def _engine(model, **kw) -> Engine:
    kw = {"threads_per_stage": 1, "kv_cache_memory": "16M", "log_level": "warning", **kw}
    return Engine(model=str(model), **kw)


def _answers(llm: Engine) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] + [o.token_ids for o in llm.generate(PROMPTS, SEEDED)]


def _recovered(llm: Engine, generation: int, timeout: float = 60.0) -> float:
    """Poll until the ring is whole in `generation`; the seconds it took."""
    sup, start = llm.supervisor, time.monotonic()
    while sup.generation < generation or sup.recovery.running:
        assert time.monotonic() - start < timeout, "the ring was not whole again in time"
        llm.poll(0.05)
    return time.monotonic() - start


def _no_leftovers(ipc_name: str) -> None:
    gone_by = time.monotonic() + 10
    while children_of(os.getpid()) and time.monotonic() < gone_by:
        time.sleep(0.1)
    assert not children_of(os.getpid()), "a child process outlived the engine"
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(ipc_name)], "shared memory left behind"


@pytest.mark.parametrize(
    ("layout", "victim", "sig"),
    [
        # (PP=3's first, last and middle stage killed: the kills in a row below)
        ({"pp_size": 3, "heartbeat_timeout": 2.0}, 1, signal.SIGSTOP),
        ({"pp_size": 2, "tp_size": 2}, 3, signal.SIGKILL),
        ({"cp_size": 2}, 1, signal.SIGKILL),
    ],
    ids=["pp3-hung", "tp2pp2-rank3", "cp2-rank1"],
)
def test_a_failed_rank_is_replaced_and_the_ring_answers_the_same(tiny_llama_dir, layout, victim, sig):
    llm = _engine(tiny_llama_dir, **layout)
    ipc = os.path.basename(llm.supervisor.ipc_dir)
    try:
        before = _answers(llm)
        old = llm.supervisor.procs[victim].pid
        os.kill(old, sig)
        _recovered(llm, 1)
        assert llm.supervisor.procs[victim].pid != old  # a new process for the same coordinates
        assert llm.supervisor.recovery.replaced == {victim: 1}
        assert _answers(llm) == before  # greedy and seeded sampling alike
    finally:
        llm.shutdown()
    _no_leftovers(ipc)


def _kill_and_recover(llm: Engine, victim: int, generation: int) -> None:
    old = llm.supervisor.procs[victim].pid
    os.kill(old, signal.SIGKILL)
    _recovered(llm, generation)
    assert llm.supervisor.procs[victim].pid != old  # a new process for the same coordinates


def test_first_and_last_stage_killed_then_two_kills_in_a_row_and_a_kill_during_a_recovery(tiny_llama_dir):
    """PP=3, one ring through every kill: the first stage, then the last (each replaced, the ring answering as
    before, greedy and seeded alike); then the middle stage, its replacement itself, and a survivor while that
    recovery runs."""
    llm = _engine(tiny_llama_dir, pp_size=3, max_restarts=5)  # five replacements in all (3 by default)
    ipc = os.path.basename(llm.supervisor.ipc_dir)
    try:
        before = _answers(llm)
        _kill_and_recover(llm, 0, 1)
        assert llm.supervisor.recovery.replaced == {0: 1}
        assert _answers(llm) == before
        _kill_and_recover(llm, 2, 2)
        assert llm.supervisor.recovery.replaced == {0: 1, 2: 1}
        assert _answers(llm) == before
        _kill_and_recover(llm, 1, 3)
        os.kill(llm.supervisor.procs[1].pid, signal.SIGKILL)  # the replacement itself
        while not llm.supervisor.recovery.running:
            llm.poll(0.02)
        os.kill(llm.supervisor.procs[2].pid, signal.SIGKILL)  # a survivor, while the recovery runs
        _recovered(llm, 4)
        assert llm.supervisor.recovery.replaced == {0: 1, 1: 2, 2: 2}
        assert _answers(llm) == before
    finally:
        llm.shutdown()
    _no_leftovers(ipc)


def test_beyond_max_restarts_the_engine_stops_as_before(tiny_llama_dir):
    llm = _engine(tiny_llama_dir, pp_size=2, max_restarts=1)
    ipc = os.path.basename(llm.supervisor.ipc_dir)
    try:
        _answers(llm)
        os.kill(llm.supervisor.procs[1].pid, signal.SIGKILL)
        _recovered(llm, 1)
        os.kill(llm.supervisor.procs[0].pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(StageFailure, match="stage 0"):
            while time.monotonic() - start < 10:
                llm.poll(0.1)
        assert time.monotonic() - start < 10
    finally:
        llm.shutdown()
    _no_leftovers(ipc)


def test_a_stage_failing_while_the_engine_starts_stops_it_without_replacing_it(tiny_llama_dir):
    """A start's failure (here a KV budget that holds no block) would meet every replacement again: the engine
    stops at once, naming the cause, rather than spending --max-restarts on it."""
    with pytest.raises(StageFailure) as failed:
        _engine(tiny_llama_dir, pp_size=2, kv_cache_memory="1K")
    message = str(failed.value)
    assert "--kv-cache-memory 1K holds no KV block" in message
    assert "recovery" not in message and "--max-restarts" not in message


def _streams(llm: Engine, kill: tuple[int, int] | None = None) -> tuple[list[list[int]], list[str]]:
    """Nine requests of 120 tokens (greedy, seeded, unseeded with a frequency penalty), read as they stream; with
    `kill` (rank, after), SIGKILL that rank once every request has `after` tokens. Tokens and errors."""
    kinds = [SamplingParams(max_tokens=120, temperature=0, ignore_eos=True),
             SamplingParams(max_tokens=120, temperature=0.9, seed=5, ignore_eos=True),
             SamplingParams(max_tokens=120, temperature=0.8, frequency_penalty=0.5, ignore_eos=True)]  # fmt: skip
    rids = [llm.submit([1 + i, 2, 3 + i], kinds[i % 3]) for i in range(9)]
    got, done, errors = {r: [] for r in rids}, set(), []
    deadline = time.monotonic() + 120
    while len(done) < len(rids):
        assert time.monotonic() < deadline, "a request never ended"
        for o in llm.poll(0.05):
            got[o.rid] += o.token_ids
            if o.finish_reason:
                done.add(o.rid)
                errors += [o.error] if o.error else []
        if kill and min(len(t) for t in got.values()) >= kill[1]:
            os.kill(llm.supervisor.procs[kill[0]].pid, signal.SIGKILL)
            kill = None
    return [got[r] for r in rids], errors


IN_FLIGHT_KW = {"pp_size": 3, "seed": 3, "enable_deterministic_inference": True}


@pytest.fixture(scope="module")
def undisturbed_streams(tiny_llama_dir) -> list[list[int]]:
    """The nine requests' tokens on a ring that loses nothing (one run for every victim below)."""
    with _engine(tiny_llama_dir, **IN_FLIGHT_KW) as llm:
        return _streams(llm)[0]


@pytest.mark.parametrize("victim", [0, 2])
def test_requests_in_flight_go_on_with_their_undisturbed_tokens(tiny_llama_dir, undisturbed_streams, victim):
    """A stage killed while nine requests stream: each ends with exactly the tokens of an undisturbed run (the
    front end replays it from what it delivered), none with an error, and every pool empties after."""
    with _engine(tiny_llama_dir, **IN_FLIGHT_KW) as llm:
        got, errors = _streams(llm, kill=(victim, 40))
        assert errors == [] and got == undisturbed_streams
        assert llm.supervisor.generation == 1 and llm.requests_replayed == 9
        assert len(llm.open_requests.pauses) == 9 and all(p > 0 for p in llm.open_requests.pauses)
        assert llm.wait_idle()["kv_usage"] == 0.0


def test_a_server_stream_pauses_and_goes_on_when_a_stage_dies():
    """PP=3 server (SmolLM2), eight streams through the `openai` client, greedy and seeded; stage 1 killed while
    they stream: every stream ends with its undisturbed text and no error, `/health` is 200 again, the metrics
    count the restart and the replays, and the KV pools empty."""
    args = ["--pp-size", "3", "--threads-per-stage", "1", "--kv-cache-memory", "64M", "--max-model-len", "512",
            "--enable-deterministic-inference"]  # exactly the undisturbed text, whatever shares a micro-batch
    with ServerProcess(args) as srv:
        undisturbed = asyncio.run(_server_streams(srv.url, None))
        got = asyncio.run(_server_streams(srv.url, lambda: os.kill(srv.stage_pid(1), signal.SIGKILL)))
        assert got == undisturbed
        assert httpx.get(f"{srv.url}/health", timeout=10).status_code == 200
        text = httpx.get(f"{srv.url}/metrics", timeout=10).text
        assert re.search(r'^ringsched:rank_restarts_total\{rank="1"\} 1\.0$', text, re.M)
        assert re.search(r"^ringsched:requests_replayed_total 8\.0$", text, re.M)
        assert re.search(r"^ringsched:request_replay_pause_seconds_count 8\.0$", text, re.M)
        deadline = time.monotonic() + 10  # the stages report every 0.5 s
        while time.monotonic() < deadline and any(float(v) for v in _kv_usage(srv.url)):
            time.sleep(0.2)
        assert _kv_usage(srv.url) and not any(float(v) for v in _kv_usage(srv.url))


def _kv_usage(url: str) -> list[str]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return re.findall(r"^ringsched:kv_cache_usage_perc\{.*\} (\S+)$", text, re.M)


async def _server_streams(url: str, kill) -> list[str]:
    counts = [0] * 8
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)

    async def one(i: int) -> str:
        extra = {"temperature": 0.8, "seed": i} if i % 2 else {"temperature": 0.0}
        stream = await client.completions.create(model="smollm2-135m-instruct", prompt=f"A story about {i}:",
                                                 max_tokens=48, stream=True, extra_body={"ignore_eos": True},
                                                 **extra)  # fmt: skip
        text = ""
        async for chunk in stream:
            text += chunk.choices[0].text
            counts[i] += 1
        return text

    tasks = [asyncio.create_task(one(i)) for i in range(8)]
    while kill and min(counts) < 8:
        await asyncio.sleep(0.01)
    if kill:
        kill()
    try:
        return await asyncio.gather(*tasks)
    finally:
        await client.close()
