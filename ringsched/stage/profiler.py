"""torch.profiler over a window of one stage's micro-batches: which operators a saturated stage spends its time
in, per stage, to compare a stage of a ring with a single-stage run on the same work.

Off unless `RINGSCHED_TORCH_PROFILER_DIR` is set (the name follows vLLM's `VLLM_TORCH_PROFILER_DIR`); stages
inherit the launcher's environment. `RINGSCHED_TORCH_PROFILER_STEPS=START:COUNT` (default `40:60`) profiles
the COUNT micro-batches after the first START, counting only micro-batches of at least
`RINGSCHED_TORCH_PROFILER_MIN_TOKENS` tokens (default 1), so a benchmark's warm-up and its ramp can be skipped
(smaller micro-batches inside the window are profiled and counted in its totals). At the window's end each
stage writes `stage{rank}_of{size}.txt`: the operators by self CPU time, grouped by input shapes, then the
window's micro-batches, tokens, layer-tokens and compute seconds, so per-token figures can be set side by
side. Code outside torch's operators (the native kernels, Python) appears only as the gap between the
operators' total and the compute seconds. Writing the table stalls the stage for a few seconds once; the
ring waits for it. A window that has started records every micro-batch until COUNT qualifying ones have run,
so on a server whose traffic stops mid-window the profiler's events wait (and hold memory) until it resumes.

The profiler object is kept until the process exits (a stage leaves by `os._exit`, so it is never destroyed):
destroying it in a stage of a ring aborted the stage with glibc's "free(): invalid next size" or a
segmentation fault, with and without `record_shapes`, with the native kernel on or off (torch 2.13, PP=2 on
gloo; PP=1 and a lone process destroy it cleanly).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from ringsched.stage.times import StageTimes

logger = logging.getLogger(__name__)

ENV_DIR = "RINGSCHED_TORCH_PROFILER_DIR"
ENV_STEPS = "RINGSCHED_TORCH_PROFILER_STEPS"
ENV_MIN_TOKENS = "RINGSCHED_TORCH_PROFILER_MIN_TOKENS"


@dataclass(frozen=True)
class ProfileWindow:
    out_dir: Path
    start: int = 40
    count: int = 60
    min_tokens: int = 1

    def __post_init__(self) -> None:
        if self.start < 1 or self.count < 1 or self.min_tokens < 1:
            raise ValueError(
                f"{ENV_STEPS}={self.start}:{self.count}, {ENV_MIN_TOKENS}={self.min_tokens}: the start, the count "
                "and the minimum tokens must all be >= 1"
            )

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> ProfileWindow | None:
        env = os.environ if env is None else env
        if not env.get(ENV_DIR):
            return None
        steps = env.get(ENV_STEPS, "40:60")
        try:
            start, count = (int(x) for x in steps.split(":"))
            min_tokens = int(env.get(ENV_MIN_TOKENS, "1"))
        except ValueError:
            raise ValueError(f"{ENV_STEPS}={steps!r}: expected START:COUNT, e.g. 40:60") from None
        return cls(Path(env[ENV_DIR]), start, count, min_tokens)


class StepProfiler:
    """Call `after_step(num_tokens, times)` after every micro-batch, with the stage's running `StageTimes`."""

    def __init__(self, window: ProfileWindow, rank: int, size: int) -> None:
        self.window, self.rank, self.size = window, rank, size
        self._seen = 0
        self._prof = None
        self._before: tuple[float, ...] = ()
        self.written: Path | None = None

    @staticmethod
    def _counters(times: StageTimes) -> tuple[float, ...]:
        return (times.batches, times.tokens, times.layer_tokens, times.compute, times.head)

    def after_step(self, num_tokens: int, times: StageTimes) -> None:
        if self.written is not None or num_tokens < self.window.min_tokens:
            return
        self._seen += 1
        if self._seen == self.window.start:  # from the next micro-batch on
            from torch.profiler import ProfilerActivity, profile

            self._prof = profile(activities=[ProfilerActivity.CPU], record_shapes=True)
            self._prof.__enter__()
            self._before = self._counters(times)
        elif self._prof is not None and self._seen == self.window.start + self.window.count:
            self._finish(times)

    def _finish(self, times: StageTimes) -> None:
        self._prof.__exit__(None, None, None)
        table = self._prof.key_averages(group_by_input_shape=True).table(
            sort_by="self_cpu_time_total", row_limit=60, max_name_column_width=28, max_shapes_column_width=70
        )
        names = ("micro-batches", "tokens", "layer-tokens", "compute s", "head s")
        deltas = [after - before for before, after in zip(self._before, self._counters(times), strict=True)]
        summary = ", ".join(f"{n} {d:.4g}" for n, d in zip(names, deltas, strict=True))
        self.window.out_dir.mkdir(parents=True, exist_ok=True)
        path = self.window.out_dir / f"stage{self.rank}_of{self.size}.txt"
        path.write_text(f"{table}\nwindow: {summary}\n")
        self.written = path  # the profiler object is kept: see the module docstring
        logger.info("torch.profiler table written to %s", path)
