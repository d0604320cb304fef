"""The supervisor's judgement, without processes: which stage is hung or stuck, and which failure is the cause."""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest

from ringsched.comm.messages import StageStatus
from ringsched.comm.tensor_channel import without_source_paths
from ringsched.config import EngineConfig
from ringsched.process.diagnosis import describe
from ringsched.process.supervisor import StageFailure, Supervisor
from ringsched.spec import ModelSpec

SPEC = ModelSpec("unused", None, 2048, (), (15, 15))  # the supervisor only keeps it here
GLOO = "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:5000"


@dataclass
class _Proc:
    pid: int
    exitcode: int | None = None

    def join(self, timeout: float | None = None) -> None:
        pass

    def kill(self) -> None:
        self.exitcode = -9


@pytest.fixture
def sup():
    s = Supervisor(EngineConfig(pp_size=2, heartbeat_timeout=10.0, stage_timeout=5.0, max_restarts=0), SPEC)
    s.ranks, s.procs = [0, 1], [_Proc(100), _Proc(101)]
    s._take_status([StageStatus(r, "ready", {"kv_tokens": 16}) for r in (0, 1)])
    yield s
    for p in s.procs:
        p.exitcode = 0
    s.stop()


def _beat(rank: int, age: float, steps: int = 0, in_step: bool = False) -> StageStatus:
    return StageStatus(rank, "heartbeat", {"sent_at": time.monotonic() - age, "steps": steps, "in_step": in_step})


def test_beating_stages_are_fine(sup):
    sup._take_status([_beat(0, 0.1), _beat(1, 0.3, steps=7, in_step=True)])
    sup.check()


def test_a_silent_stage_is_hung_idle_or_busy(sup):
    sup._take_status([_beat(0, 0.1), _beat(1, 10.5, steps=3, in_step=True)])
    hung = r"stage 1 \(pid 101\) is hung: no heartbeat for 10\.\ds \(--heartbeat-timeout 10\)"
    with pytest.raises(StageFailure, match=hung):
        sup.check()


def test_a_stage_that_never_beat_after_ready_is_hung(sup):
    sup.ready_at[0] -= 11.0
    sup._take_status([_beat(1, 0.1)])
    with pytest.raises(StageFailure, match="stage 0 .* is hung"):
        sup.check()


def test_a_loop_inside_one_micro_batch_too_long_is_stuck(sup):
    sup._take_status([_beat(0, 0.1), _beat(1, 6.0, steps=4, in_step=True)])
    sup.check()  # one beat: the clock starts at that beat
    sup._take_status([_beat(0, 0.1), _beat(1, 0.2, steps=4, in_step=True)])
    with pytest.raises(StageFailure, match=r"stage 1 \(pid 101\) is stuck: .* \(--stage-timeout 5\)"):
        sup.check()


def test_progress_or_idleness_is_not_stuck(sup):
    sup._take_status([_beat(0, 0.1), _beat(1, 6.0, steps=4, in_step=True)])
    sup.check()
    sup._take_status([_beat(0, 0.1), _beat(1, 0.2, steps=5, in_step=True)])  # it moved on
    sup.check()
    sup._take_status([_beat(0, 0.1), _beat(1, 6.0, steps=5, in_step=False), _beat(1, 0.1, steps=5)])
    sup.check()


def test_the_cause_is_named_not_the_neighbour_that_lost_it():
    s = Supervisor(EngineConfig(pp_size=2, max_restarts=0), SPEC)
    errors = {
        0: f"PeerLost: stage 0 lost stage 1: {GLOO}\nTraceback ...",
        1: "IndexError: index 50000 is out of bounds for dimension 1 with size 49152\nTraceback ...",
    }
    text = describe(s, errors, [])
    first = text.splitlines()[0]
    assert first.startswith("stage 1 failed: IndexError: index 50000") and "then stage 0 stopped too" in first
    assert describe(s, {0: errors[0]}, []).startswith("stage 0 failed: PeerLost: stage 0 lost stage 1: Connection")
    assert ".cc:" not in text
    s.stop()


def test_source_paths_are_dropped():
    assert without_source_paths(f"stage 0 lost stage 1: {GLOO}") == (
        "stage 0 lost stage 1: Connection closed by peer [127.0.0.1]:5000"
    )


def test_the_ready_log_says_what_the_pools_allow_a_request(caplog):
    from ringsched.process.ready_log import log_ready

    info = {r: {"layers": [0, 15], "weights_bytes": 2**20, "kv_tokens": 4096, "threads": 1, "cpus": [0], "pid": 1}
            for r in (0, 1)}  # fmt: skip
    with caplog.at_level("INFO", logger="ringsched.launch"):
        log_ready(EngineConfig(pp_size=2), info, 2048)
        log_ready(EngineConfig(pp_size=2), info, 8192)
    assert any("may hold 2048 tokens (--max-model-len 2048), 2.0 requests" in r.message for r in caplog.records)
    warned = [r.message for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and "4096 tokens, less than --max-model-len 8192" in warned[0]
