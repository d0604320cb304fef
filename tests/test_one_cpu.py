"""A PP=2 server confined to one CPU (`taskset -c 0`, or a SLURM task of one CPU) sizes each stage at one thread
from its affinity mask, not the machine's core count, and serves."""

from __future__ import annotations

import os

import httpx
import psutil
import pytest

from ringsched.bench.server_process import ServerProcess
from ringsched.config import EngineConfig

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs CPU affinity (Linux)")


class _OnCpu0:
    """This process (and what it starts meanwhile, which inherits the mask) on CPU 0 only, as `taskset -c 0`."""

    def __enter__(self) -> None:
        self.old = os.sched_getaffinity(0)
        os.sched_setaffinity(0, {min(self.old)})

    def __exit__(self, *exc) -> None:
        os.sched_setaffinity(0, self.old)


def test_threads_follow_the_affinity_mask():
    with _OnCpu0():
        assert EngineConfig(pp_size=2, device="cpu").threads == 1
        assert EngineConfig(pp_size=1, device="cpu").threads == 1


@pytest.mark.slow
def test_pp2_server_on_one_cpu_serves(tiny_llama_dir):
    args = ["--model", str(tiny_llama_dir), "--pp-size", "2", "--kv-cache-memory", "16M", "--device", "cpu"]
    with _OnCpu0(), ServerProcess(args) as srv:  # the launcher and its stages inherit the one-CPU mask
        for rank in range(2):
            assert psutil.Process(srv.stage_pid(rank)).cpu_affinity() == [min(os.sched_getaffinity(0))]
        body = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8
