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
