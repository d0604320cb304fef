"""A stage's accounting: totals since start, and busy/bubble fractions over the last window only."""

from __future__ import annotations

import pytest

from ringsched.stage import times as stage_times
from ringsched.stage.times import WINDOW_S, StageTimes


def test_fractions_cover_the_last_window_not_the_whole_run(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(stage_times.time, "perf_counter", lambda: now[0])
    t = StageTimes(start=now[0])
    # A busy minute: computing 90% of the time.
    for _ in range(120):
        now[0] += 0.5
        t.compute += 0.45
        first = t.snapshot()
    assert first["busy_fraction"] == pytest.approx(0.9)
    # Then waiting on a neighbour for a window and a half: the fractions follow, the totals keep the history.
    for _ in range(int(1.5 * WINDOW_S / 0.5)):
        now[0] += 0.5
        t.wait_prev += 0.5
        snap = t.snapshot()
    assert snap["busy_fraction"] == pytest.approx(0.0, abs=1e-9)
    assert snap["bubble_fraction"] == pytest.approx(1.0)
    assert snap["compute_s"] == pytest.approx(54.0) and snap["wall_s"] == pytest.approx(60.0 + 1.5 * WINDOW_S)


def test_idle_time_is_left_out_and_the_first_snapshot_covers_since_start(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(stage_times.time, "perf_counter", lambda: now[0])
    t = StageTimes(start=now[0])
    now[0] = 2.0
    t.compute, t.idle = 0.5, 1.0
    assert t.snapshot()["busy_fraction"] == pytest.approx(0.5)  # 0.5 s of 1 s not idle
    now[0] = 4.0
    t.idle += 2.0  # a window spent idle: nothing to share out
    assert t.snapshot()["busy_fraction"] == 0.0


class _FakeEvent:
    """A CUDA timing event as `StageTimes` uses it: done once `finish` is called, then `elapsed_time` in ms."""

    def __init__(self, at_ms: float) -> None:
        self.at_ms, self.done = at_ms, False

    def record(self) -> None:
        pass

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, end: _FakeEvent) -> float:
        return end.at_ms - self.at_ms


def test_on_cuda_compute_is_the_devices_time_settled_at_the_next_snapshot(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(stage_times.time, "perf_counter", lambda: now[0])
    pairs = [(_FakeEvent(0.0), _FakeEvent(30.0)), (_FakeEvent(0.0), _FakeEvent(50.0))]
    monkeypatch.setattr(stage_times, "_cuda_events", lambda: pairs.pop(0))
    t = StageTimes(start=0.0, cuda=True)
    with t.measure("compute") as took:
        now[0] += 0.002  # the host only launched the kernels: 2 ms
    assert took.seconds == pytest.approx(0.002) and t.compute == 0.0  # not yet: the GPU is still at it
    with t.measure("sched"):
        now[0] += 0.001  # host kinds stay on the host clock
    assert t.sched == pytest.approx(0.001)
    first_end = t._events[0][2]
    first_end.done = True
    with t.measure("compute"):
        now[0] += 0.002
    assert t.snapshot()["compute_s"] == pytest.approx(0.030)  # the finished pair only
    t._events[0][2].done = True
    assert t.snapshot()["compute_s"] == pytest.approx(0.080)
