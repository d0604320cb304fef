"""When a stage lets Python's cycle collector run.

Measured on stage 0 of a 2-stage SmolLM2 ring on CPU: with the default thresholds the collector ran inside
the forward pass (every tensor op allocates tracked objects) and scanned every live object — the planner's
requests and token lists included — costing ~14% of stage 0's compute and unbalancing the ring (stage 0's
layers took 17% longer than the same layers on stage 1). So a stage freezes what it built at start-up (weights'
wrappers, modules: they never die), turns automatic collection off, and collects itself at known points: the
young generations every `young_every` micro-batches, everything when idle (at most every `full_every_s`).
Reference cycles are rare here (refcounting frees the rest at once), so this bounds memory all the same.
"""

from __future__ import annotations

import gc
import time


class GcPolicy:
    def __init__(self, young_every: int = 256, full_every_s: float = 10.0) -> None:
        self.young_every, self.full_every_s = young_every, full_every_s
        self._steps = 0
        self._last_full = time.monotonic()

    def start(self) -> None:
        gc.collect()
        gc.freeze()
        gc.disable()

    def after_step(self) -> None:
        self._steps += 1
        if self._steps % self.young_every == 0:
            gc.collect(1)

    def idle(self) -> None:
        now = time.monotonic()
        if now - self._last_full >= self.full_every_s:
            gc.collect()
            self._last_full = now

    def stop(self) -> None:
        gc.enable()
