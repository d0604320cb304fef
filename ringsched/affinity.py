"""Which CPUs a stage runs on: its own `threads` cores when this node has enough for all its stages, so two
stages never fight over a core. The stage pins itself; `--pp-layer-partition auto` measures on the same cores."""

from __future__ import annotations

import os


def stage_cpus(threads: int, stages_here: int, local_rank: int, device: str) -> list[int] | None:
    """The cores stage `local_rank` of this node is pinned to, or None (GPU stages, or too few cores)."""
    if not hasattr(os, "sched_getaffinity") or device == "cuda":
        return None
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < threads * stages_here:
        return None
    return cpus[local_rank * threads : (local_rank + 1) * threads]
