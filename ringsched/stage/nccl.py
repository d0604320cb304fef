"""What the ring does differently when its seams run over NCCL (`--device cuda`).

- **A dead peer is an exception, not a kill.** PyTorch's NCCL watchdog tears the process down on an error or a
  timeout by default (`TORCH_NCCL_ASYNC_ERROR_HANDLING=3`); the ring sets 2, which aborts the communicator and
  lets the waiting call raise, so the loop reports the lost peer and `--max-restarts` can replace it.
- **Waits a signal can interrupt.** A CUDA stream waiting on a dead peer never returns to the host, so a rank
  waits for a seam by polling the operation (`PolledWait`) between liveness checks (the supervisor's request to
  rejoin, the launcher gone), up to `--stage-timeout`.
- **Leaving a generation aborts its communicators** (`release_groups`): destroying them can hang on an operation
  still pending to the dead peer (PyTorch #141510), and an aborted communicator frees its buffers before the next
  generation makes its own.
- **Every rank on one GPU, for checks** (`RINGSCHED_ONE_GPU=1`, `device.py`): each rank gets its own
  `NCCL_HOSTID`, so NCCL takes the ranks for separate hosts, passes its duplicate-device check and connects them
  over its socket transport; the ring runs its real device path on a machine with one GPU.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch

from ringsched.config import EngineConfig
from ringsched.device import one_gpu
from ringsched.layout.rank import RankInfo

ERROR_HANDLING_ENV = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
ABORT_COMMUNICATOR_ONLY = "2"  # PyTorch's CleanUpOnly: abort the communicator, keep the process
POLL_S = 0.0002  # between two looks at an operation in flight (the liveness checks cost less than that)


def nccl_setup(cfg: EngineConfig, where: RankInfo) -> None:
    """Before the process group is made: the watchdog's error mode and, with RINGSCHED_ONE_GPU, this rank's host
    id. (Environment variables: NCCL and PyTorch read them when the group starts.)"""
    if cfg.backend != "nccl":
        return
    os.environ.setdefault(ERROR_HANDLING_ENV, ABORT_COMMUNICATOR_ONLY)
    if one_gpu():
        os.environ["NCCL_HOSTID"] = f"ringsched-rank{where.rank}"


class PolledWait:
    """Wait for a `torch.distributed` operation by looking at it, so `alive` (which raises to stop) runs between
    looks; past `timeout_s`, a `RuntimeError` that names `what`."""

    def __init__(self, timeout_s: float, alive: Callable[[], None]) -> None:
        self.timeout_s, self.alive = timeout_s, alive

    def __call__(self, work, what: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not work.is_completed():
            self.alive()
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not complete within --stage-timeout ({self.timeout_s:g} s)")
            time.sleep(POLL_S)
        work.wait()  # raises what the operation failed with (an aborted communicator)


def waits_for(cfg: EngineConfig, alive: Callable[[], None]) -> PolledWait | None:
    """How this rank's seam channel waits: polled on NCCL, blocking on gloo (a gloo peer that dies closes its
    connection, which fails the wait at once; a blocking wait costs no CPU the stage's compute needs)."""
    return PolledWait(cfg.stage_timeout, alive) if cfg.backend == "nccl" else None


def release_groups(backend: str) -> None:
    """Leave this generation's process groups: aborted on NCCL, destroyed on gloo."""
    if not torch.distributed.is_initialized():
        return
    if backend == "nccl":
        torch.distributed.distributed_c10d._abort_process_group()
    else:
        torch.distributed.destroy_process_group()
