"""What the ring does differently on NCCL (`stage/nccl.py`), checked on CPU with fakes: the watchdog's error mode,
the one-GPU mode's host ids and its refusal off CUDA, waits a signal can interrupt, communicators aborted (not
destroyed) when a rank leaves its generation, before the next one's are made."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from ringsched.device import ONE_GPU_ENV, gpu_index
from ringsched.stage import nccl, rejoin
from ringsched.stage.setup import RankSetup


@pytest.fixture
def clean_env(monkeypatch):
    for name in (nccl.ERROR_HANDLING_ENV, "NCCL_HOSTID", ONE_GPU_ENV):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_nccl_ranks_abort_their_communicator_instead_of_dying(clean_env):
    nccl.nccl_setup(SimpleNamespace(backend="gloo"), SimpleNamespace(rank=1))
    assert nccl.ERROR_HANDLING_ENV not in os.environ
    nccl.nccl_setup(SimpleNamespace(backend="nccl"), SimpleNamespace(rank=1))
    assert os.environ[nccl.ERROR_HANDLING_ENV] == "2"
    assert "NCCL_HOSTID" not in os.environ  # one GPU a rank: NCCL's own host id


def test_one_gpu_mode_gives_each_rank_a_host_of_its_own_on_gpu_0(clean_env):
    clean_env.setenv(ONE_GPU_ENV, "1")
    ids = set()
    for rank in range(3):
        nccl.nccl_setup(SimpleNamespace(backend="nccl"), SimpleNamespace(rank=rank))
        ids.add(os.environ["NCCL_HOSTID"])
        assert gpu_index(rank) == 0
    assert len(ids) == 3
    clean_env.delenv(ONE_GPU_ENV)
    assert [gpu_index(r) for r in range(3)] == [0, 1, 2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_one_gpu_mode_is_refused_off_cuda_with_the_fix(clean_env):
    """The config check the launcher runs first (its errors are one line and exit 2: `test_config`)."""
    from ringsched.config import ConfigError, EngineConfig

    clean_env.setenv(ONE_GPU_ENV, "1")
    with pytest.raises(ConfigError) as e:
        EngineConfig(device="cpu")
    assert (
        f"{ONE_GPU_ENV}=1" in str(e.value)
        and "--device cuda" in str(e.value)
        and f"unset {ONE_GPU_ENV}" in str(e.value)
    )


class _Work:
    def __init__(self, done_after: int | None) -> None:
        self.polls, self.done_after, self.waited = 0, done_after, False

    def is_completed(self) -> bool:
        self.polls += 1
        return self.done_after is not None and self.polls > self.done_after

    def wait(self) -> None:
        self.waited = True


def test_polled_wait_returns_when_the_operation_completes():
    work = _Work(done_after=3)
    nccl.PolledWait(5.0, lambda: None)(work, "a receive from rank 1")
    assert work.polls == 4 and work.waited  # `wait` raises what a failed operation failed with


def test_polled_wait_lets_the_supervisor_take_the_rank_out():
    calls = []

    def alive():
        calls.append(1)
        if len(calls) == 5:
            raise rejoin.Rejoin("the supervisor is replacing a rank of the ring")

    work = _Work(done_after=None)  # a peer that died: its operation never completes
    with pytest.raises(rejoin.Rejoin):
        nccl.PolledWait(60.0, alive)(work, "a receive from rank 1")
    assert work.polls == 5 and not work.waited


def test_polled_wait_gives_up_at_the_stage_timeout_naming_the_operation():
    with pytest.raises(RuntimeError, match=r"a receive from rank 2 did not complete within --stage-timeout \(0.05 s\)"):
        nccl.PolledWait(0.05, lambda: None)(_Work(done_after=None), "a receive from rank 2")


def test_seam_channel_polls_on_nccl_only():
    assert nccl.waits_for(SimpleNamespace(backend="gloo", stage_timeout=5), lambda: None) is None
    assert isinstance(nccl.waits_for(SimpleNamespace(backend="nccl", stage_timeout=5), lambda: None), nccl.PolledWait)


@pytest.mark.parametrize("backend, expected", [("nccl", ["abort"]), ("gloo", ["destroy"])])
def test_leaving_a_generation_aborts_nccl_communicators(monkeypatch, backend, expected):
    calls = []
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed.distributed_c10d, "_abort_process_group", lambda: calls.append("abort"))
    monkeypatch.setattr(torch.distributed, "destroy_process_group", lambda: calls.append("destroy"))
    setup = RankSetup.__new__(RankSetup)  # what `leave` reads of a rank that connected once
    setup.cfg, setup.loop, setup.tp, setup.cp = SimpleNamespace(backend=backend), None, None, None
    setup.leave()
    assert calls == expected


def test_a_rank_releases_its_generation_before_it_joins_the_next(monkeypatch):
    from ringsched.stage import worker
    from ringsched.stage.loop import PeerLost

    calls = []

    class Loop:
        def run(self):
            calls.append("run")
            if calls.count("run") == 1:
                raise PeerLost("stage 1 lost stage 0: Connection closed by peer")

    class Setup:
        where, cfg, store, loop = SimpleNamespace(rank=1), SimpleNamespace(restarts_enabled=True), None, Loop()
        ctx = addrs = SimpleNamespace(ctl="")

        def connect(self, generation):
            calls.append(f"connect {generation}")
            return None, {}

        def leave(self):
            calls.append("leave")  # `RankSetup.leave`: the loop's sockets, then `release_groups`

        def parent_alive(self):
            pass

    monkeypatch.setattr(worker, "_start_heartbeat", lambda *a: None)
    monkeypatch.setattr(rejoin, "wait_generation", lambda store, gen, alive: calls.append("wait") or gen + 1)
    worker._serve(Setup(), SimpleNamespace(send=lambda status: calls.append(status.state)), 0)
    assert calls == ["connect 0", "ready", "run", "lost", "leave", "wait", "connect 1", "ready", "run"]
