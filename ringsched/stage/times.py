"""Where a stage's time goes, and how much memory it has used: the per-stage accounting that `/metrics`,
`bench offline` and `bench sweep` report."""

from __future__ import annotations

import resource
import sys
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

WINDOW_S = 5.0  # busy_fraction and bubble_fraction cover about this many seconds before each snapshot
GPU_KINDS = ("compute", "head")  # on a GPU these are the device's time, not the host's (which sees only launches)


@dataclass
class Took:
    seconds: float = 0.0


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
    # On CUDA, GPU_KINDS are timed with CUDA events, settled into the totals at the next snapshot once done.
    cuda: bool = False
    # (time, compute, wait, idle) at recent snapshots: the window the fractions are measured over.
    _marks: deque = field(default_factory=deque, repr=False)
    _events: list = field(default_factory=list, repr=False)  # (kind, start, end) CUDA events not yet settled

    @contextmanager
    def measure(self, kind: str) -> Iterator[Took]:
        """`with times.measure("compute") as took:` adds the block's seconds to that kind (compute, head,
        wait_prev, wait_output, idle, sched or comm); `took.seconds` has them after the block."""
        took, start = Took(), time.perf_counter()
        events = _cuda_events() if self.cuda and kind in GPU_KINDS else None
        try:
            yield took
        finally:
            took.seconds = time.perf_counter() - start  # the host's view: what the caller waited
            if events is None:
                setattr(self, kind, getattr(self, kind) + took.seconds)
            else:
                events[1].record()  # no synchronisation here: read back at the next snapshot
                self._events.append((kind, *events))

    def _settle(self) -> None:
        """Add the device time of every finished CUDA-event pair to its kind."""
        pending = []
        for kind, start, end in self._events:
            if end.query():
                setattr(self, kind, getattr(self, kind) + start.elapsed_time(end) / 1e3)
            else:
                pending.append((kind, start, end))
        self._events = pending

    def count(self, tokens: int, layers: int) -> None:
        """One micro-batch computed: `tokens` through `layers` layers."""
        self.batches += 1
        self.tokens += tokens
        self.layer_tokens += tokens * layers

    def snapshot(self) -> dict:
        """Totals since the first micro-batch, and `busy_fraction`/`bubble_fraction`: the shares of the last
        `WINDOW_S` seconds (leaving out idle time) spent computing and waiting on a neighbour."""
        self._settle()
        now = time.perf_counter()
        wall = max(now - self.start - self.idle, 1e-9)
        wait = self.wait_prev + self.wait_output
        self._marks.append((now, self.compute, wait, self.idle))
        while len(self._marks) > 2 and now - self._marks[1][0] >= WINDOW_S:
            self._marks.popleft()  # the second-oldest mark still spans the window
        t0, compute0, wait0, idle0 = self._marks[0] if len(self._marks) > 1 else (self.start, 0.0, 0.0, 0.0)
        span = now - t0 - (self.idle - idle0)
        busy, bubble = ((self.compute - compute0) / span, (wait - wait0) / span) if span > 1e-6 else (0.0, 0.0)
        return {
            "busy_fraction": busy,
            "bubble_fraction": bubble,
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


def _cuda_events() -> tuple:
    """A started pair of timing events on the current CUDA stream."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    return start, end
