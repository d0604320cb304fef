"""`--pp-flex-policy ready`: the cut of a micro-batch decided while it runs (`ringsched/layout/flex.py` says why).

Stage 1 tells stage 0, before each of its layers, when it expects to finish the micro-batch it is computing
(`StageProgress`: its pace so far in this micro-batch times the layers left, plus the head's time per sampled
row last time), and that it has finished (`done`). Stage 0 runs the first `lo` layers, then before each shared
layer reads those messages without blocking and cuts when one more layer would keep stage 1 waiting longer
than cutting now keeps stage 0 waiting: when stage 1 is done, or expected done within half a layer. Either
stage's idle lengthens the ring's cycle alike, so the rule minimises their sum one layer at a time. A cut at
the first finished-or-nearly moment, not a predicted one, follows a micro-batch that runs slow on a noisy
host, and the message before each layer lets stage 0 cut half a layer ahead of stage 1 rather than half a
layer behind it (measured: a cut on `done` alone kept stage 1 waiting half a layer per micro-batch, as much
as the predicted cut's misses).

The clock is the wall clock (`time.time()`): the same for both stages on one node; across nodes an offset
between their clocks moves the cut, never the tokens.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from ringsched.comm.messages import BatchPlan, StageProgress
from ringsched.comm.zmq_io import Puller, Pusher
from ringsched.layout.flex import FlexBoundary


class ReadyCut:
    """Stage 0: the layers of a micro-batch, up to the moment stage 1 is (about to be) ready for it."""

    def __init__(self, boundary: FlexBoundary, progress_in: Puller) -> None:
        self.b, self.progress_in = boundary, progress_in
        self._done_upto = -1  # the newest micro-batch stage 1 has finished
        self._expected: tuple[int, float] = (-1, 0.0)  # (micro-batch, finish_at) of stage 1's latest forecast

    def layers(self, plan: BatchPlan, cap: int | None = None) -> Iterator[int]:
        """Layers `[0, lo)`, then each shared layer until `_cut_now`; `plan.cut` is set when the caller has run
        the last layer (`cap`, else `hi`, at the latest)."""
        last = self.b.hi if cap is None else cap
        start = time.perf_counter()  # the caller asks for the first layer after the embedding
        yield from range(self.b.lo)
        for i in range(self.b.lo, last):  # lo >= 1 (FlexBoundary)
            if self._cut_now(plan.seq, (time.perf_counter() - start) / i):
                plan.cut = i
                return
            yield i
        plan.cut = last

    def _cut_now(self, seq: int, layer_s: float) -> bool:
        if self._done_upto < seq - 1:
            for msg in self.progress_in.drain():
                if msg.done:
                    self._done_upto = max(self._done_upto, msg.seq)
                elif msg.seq >= self._expected[0]:
                    self._expected = (msg.seq, msg.finish_at)
        if self._done_upto >= seq - 1:
            return True
        expected_seq, finish_at = self._expected
        return expected_seq == seq - 1 and finish_at - time.time() < layer_s / 2


class ProgressReporter:
    """Stage 1: the forecasts and the `done` that `ReadyCut` reads."""

    def __init__(self, progress_out: Pusher) -> None:
        self.progress_out = progress_out
        self._layer_s = 0.0  # the last micro-batch's time per layer (no forecast before one is known)
        self._head_row_s = 0.0  # the head's time per sampled row, last time rows were sampled

    def layers(self, plan: BatchPlan, layers: range) -> Iterator[int]:
        start = time.perf_counter()
        head_s = self._head_row_s * plan.sample_rows
        for j, i in enumerate(layers):
            layer_s = (time.perf_counter() - start) / j if j else self._layer_s
            if layer_s > 0:
                finish_at = time.time() + (len(layers) - j) * layer_s + head_s
                self.progress_out.send(StageProgress(plan.seq, finish_at))
            yield i
        if len(layers):
            self._layer_s = (time.perf_counter() - start) / len(layers)

    def head_took(self, rows: int, seconds: float) -> None:
        if rows:
            self._head_row_s = seconds / rows

    def done(self, plan: BatchPlan) -> None:
        self.progress_out.send(StageProgress(plan.seq, time.time(), done=True))
