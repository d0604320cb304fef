"""A failed rank replaced (`--max-restarts`): the real ring (gloo, ZMQ, spawned stages) of a tiny random model loses
a rank to SIGKILL or SIGSTOP, the supervisor replaces it, the others rejoin, and the ring answers as before; beyond
the limit the engine stops as it always did."""

from __future__ import annotations

import os
import signal
import time

import pytest
from ring_utils import children_of

from ringsched.engine import Engine
from ringsched.process.supervisor import StageFailure
from ringsched.sampling import SamplingParams

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
        ({"pp_size": 3}, 0, signal.SIGKILL),
        ({"pp_size": 3}, 1, signal.SIGKILL),
        ({"pp_size": 3}, 2, signal.SIGKILL),
        ({"pp_size": 3, "heartbeat_timeout": 2.0}, 1, signal.SIGSTOP),
        ({"pp_size": 2, "tp_size": 2}, 3, signal.SIGKILL),
        ({"cp_size": 2}, 1, signal.SIGKILL),
    ],
    ids=["pp3-first", "pp3-middle", "pp3-last", "pp3-hung", "tp2pp2-rank3", "cp2-rank1"],
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


def test_two_kills_in_a_row_and_a_kill_during_a_recovery(tiny_llama_dir):
    llm = _engine(tiny_llama_dir, pp_size=3)
    try:
        before = _answers(llm)
        os.kill(llm.supervisor.procs[1].pid, signal.SIGKILL)
        _recovered(llm, 1)
        os.kill(llm.supervisor.procs[1].pid, signal.SIGKILL)  # the replacement itself
        while not llm.supervisor.recovery.running:
            llm.poll(0.02)
        os.kill(llm.supervisor.procs[2].pid, signal.SIGKILL)  # a survivor, while the recovery runs
        _recovered(llm, 2)
        assert llm.supervisor.recovery.replaced == {1: 2, 2: 1}
        assert _answers(llm) == before
    finally:
        llm.shutdown()


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
