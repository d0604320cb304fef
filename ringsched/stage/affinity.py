"""Which CPUs a stage runs on: its own `threads` cores when this node has enough for all its stages, so two
stages never fight over a core. The stage pins itself; `--pp-layer-partition auto` measures on the same cores."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch


def stage_cpus(threads: int, stages_here: int, local_rank: int, device: str) -> list[int] | None:
    """The cores stage `local_rank` of this node is pinned to, or None (GPU stages, or too few cores)."""
    if not hasattr(os, "sched_getaffinity") or device == "cuda":
        return None
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < threads * stages_here:
        return None
    return cpus[local_rank * threads : (local_rank + 1) * threads]


def allowed_cpus() -> list[int]:
    """The CPUs this process may run on (its affinity: taskset, or what SLURM's task plugin bound), [] where the
    OS does not say."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


def cpu_list(cpus: list[int]) -> str:
    """CPUs as Linux writes them (/proc/<pid>/status Cpus_allowed_list): "0-3,8"; "?" for none known."""
    runs: list[list[int]] = []
    for c in sorted(cpus):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs) or "?"


@contextmanager
def restored_threads_and_cpus(threads: int) -> Iterator[list[int]]:
    """Run with `threads` torch threads (callers may pin to any of the yielded CPUs, this process's allowed
    set), then put both the thread count and the CPU set back: the launcher measures as a stage would."""
    old_threads = torch.get_num_threads()
    old_cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    torch.set_num_threads(threads)
    try:
        yield old_cpus
    finally:
        torch.set_num_threads(old_threads)
        if old_cpus:
            os.sched_setaffinity(0, old_cpus)
