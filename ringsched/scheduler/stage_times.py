"""Where a stage's time goes, and how much memory it has used: the per-stage accounting that `/metrics`,
`bench offline` and `bench sweep` report."""

from __future__ import annotations

import resource
import sys
import time
from dataclasses import dataclass, field


@dataclass
class StageTimes:
    """Where a stage's wall time goes (seconds since the first micro-batch)."""

    compute: float = 0.0
    head: float = 0.0  # last stage, part of compute: lm_head and sampling
    wait_prev: float = 0.0  # blocked on the previous stage (plan or proxy): the bubble
    wait_output: float = 0.0  # stage 0: blocked on the sampled tokens coming back
    idle: float = 0.0  # nothing to do at all
    sched: float = 0.0  # planning (stage 0) or applying a plan: admission, KV blocks, sampler state
    comm: float = 0.0  # posting sends and relaying plans (waits for a neighbour are counted above)
    start: float = field(default_factory=time.perf_counter)
    batches: int = 0
    tokens: int = 0
    layer_tokens: int = 0  # tokens times the layers they ran through here (a flexible cut varies the layers)
    sample_rows: int = 0  # last stage: rows through the final norm, lm_head and sampling

    def snapshot(self) -> dict:
        wall = max(time.perf_counter() - self.start - self.idle, 1e-9)
        return {
            "busy_fraction": self.compute / wall,
            "bubble_fraction": (self.wait_prev + self.wait_output) / wall,
            "compute_s": self.compute,
            "head_s": self.head,
            "wait_s": self.wait_prev + self.wait_output,
            "sched_s": self.sched,
            "comm_s": self.comm,
            "wall_s": wall,
            "batches": self.batches,
            "tokens": self.tokens,
            "layer_tokens": self.layer_tokens,
            "sample_rows": self.sample_rows,
        }


def peak_rss_bytes() -> int:
    """This process's peak resident memory. On Linux its own `VmHWM`: `ru_maxrss` starts from the parent's
    high-water mark at exec, so a small stage spawned by a large process would report the parent's peak.
    Elsewhere `ru_maxrss` (KiB on Linux, bytes on macOS)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024
