"""`--linear-tuning`: the path each linear layer takes follows the measurement (here fake timings), is cached and
read back without measuring, is keyed by what the timings depend on, and `off` keeps the fixed thresholds."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from ringsched.config import ConfigError, EngineConfig
from ringsched.kernels import linear_timing, linear_tuning, small_linear
from ringsched.kernels.linear_tuning import BUCKETS, PathTable, Shape
from ringsched.kernels.small_linear import NATIVE, TORCH, FixedPaths
from ringsched.layout.rank import StageInfo
from ringsched.models.loader import load_stage_model
from ringsched.models.random_model import random_config, write_random_model

needs_kernel = pytest.mark.skipif(small_linear.library() is None, reason="no C compiler: the kernel is no candidate")
CPU = ("Test CPU", "fpu avx2")


@pytest.fixture
def tiny(tmp_path):
    cfg = random_config("llama", layers=3, hidden=64, heads=4, kv_heads=2, intermediate=96, vocab=300, tie=True)
    model_dir = write_random_model(tmp_path / "m", cfg, seed=0)
    return lambda dtype=torch.float32: load_stage_model(model_dir, StageInfo(0, 1, 0, 3), dtype=dtype)


def fake(native_up_to: int, calls: list | None = None):
    """Timings in which the kernel wins up to `native_up_to` rows and torch beyond (any other path is slower)."""

    def measure(shape: Shape, paths: tuple[str, ...], layers) -> dict[int, dict[str, float]]:
        if calls is not None:
            calls.append(shape)
        out = {}
        for b in BUCKETS:
            won = NATIVE if b <= native_up_to else TORCH
            out[b] = {p: (1.0 if p == won else 2.0 + 0.1 * b) for p in paths}
        return out

    return measure


def test_a_row_count_between_buckets_takes_the_bucket_above():
    table = PathTable((1, 2, 4, 8, 16), ("native", "native", "torch", "native", "widen"))
    assert [table.path(r) for r in (1, 2, 3, 4, 5, 8, 9, 16, 17, 10_000)] == [
        "native", "native", "torch", "torch", "native", "native", "widen", "widen", "widen", "widen"
    ]  # fmt: skip


@needs_kernel
def test_the_paths_follow_the_timings_and_the_cache_is_read_back(tiny, tmp_path):
    model, calls = tiny(), []
    linear_tuning.tune_stage(model, "auto", torch.float32, measure=fake(16, calls), root=tmp_path, cpu=CPU)
    shapes = {linear_tuning.shape_of(lin, torch.float32) for lin in model.linears()}
    assert set(calls) == shapes and len(calls) == len(shapes) == 5  # q/k/v, o, gate/up, down, the head
    for lin in model.linears():
        assert [lin.paths.path(b) for b in BUCKETS] == [NATIVE] * 5 + [TORCH] * 4
        assert lin.paths.path(17) == TORCH and lin.paths.path(3) == NATIVE and lin.paths.path(1000) == TORCH
    assert len(list((tmp_path / "tuning").glob("*.json"))) == 5
    whole = model.__dict__["decode_layers"]
    assert whole.ok and whole.rows == frozenset(range(1, 17))  # the one call follows the linear layers' choice

    again, rechecked = tiny(), []

    def holds(shape, paths, layers, times):
        rechecked.append(shape)
        return True

    kw = {"measure": fake(0, calls), "recheck": holds, "root": tmp_path, "cpu": CPU}
    linear_tuning.tune_stage(again, "auto", torch.float32, **kw)
    assert len(calls) == 5  # the second start read every shape's timings instead of measuring
    assert set(rechecked) == shapes  # ... and spot-checked each
    assert [lin.paths for lin in again.linears()] == [lin.paths for lin in model.linears()]


def test_a_cached_choice_that_loses_its_spot_check_is_measured_again(tiny, tmp_path, monkeypatch):
    """A cache spoiled by one bad measurement (torch timed fastest at every bucket while another process ran
    beside the kernel's calls) is not kept for good: at the next start the spot check (fake timings: the kernel
    3x faster than torch at one row) finds the choice losing, so the shape is measured again and the cache
    rewritten; a choice that holds (the second start after) is kept without measuring."""
    layers = tiny().linears()[:1]
    shape = linear_tuning.shape_of(layers[0], torch.float32)
    linear_tuning.tune(layers, torch.float32, measure=fake(0), root=tmp_path, cpu=CPU)  # the spoiled cache
    assert layers[0].paths.path(1) == TORCH
    checked = []

    def fake_time_paths(paths, x, pieces):
        checked.append((paths, x.shape[0]))
        return {p: {NATIVE: 1e-6, TORCH: 3e-6}[p] for p in paths}

    monkeypatch.setattr(linear_timing, "_time_paths", fake_time_paths)
    calls: list = []
    linear_tuning.tune(layers, torch.float32, measure=fake(16, calls), root=tmp_path, cpu=CPU)
    assert checked == [((TORCH, NATIVE), 1)] and calls == [shape] and layers[0].paths.path(1) == NATIVE
    linear_tuning.tune(layers, torch.float32, measure=fake(0, calls), root=tmp_path, cpu=CPU)
    assert calls == [shape] and layers[0].paths.path(1) == NATIVE  # the rewritten cache holds its check


@needs_kernel
def test_where_torch_wins_every_bucket_the_one_call_decode_is_off(tiny, tmp_path):
    model = tiny()
    linear_tuning.tune_stage(model, "auto", torch.float32, measure=fake(0), root=tmp_path, cpu=CPU)
    assert not model.__dict__["decode_layers"].ok
    x = torch.randn(3, 64)
    with torch.no_grad():
        lin = model.linears()[0]
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias))


def test_off_keeps_the_fixed_thresholds(tiny, tmp_path):
    model = tiny()
    linear_tuning.tune_stage(model, "off", torch.float32, measure=fake(256), root=tmp_path, cpu=CPU)
    kernel = small_linear.library() is not None
    assert {lin.paths for lin in model.linears()} == {FixedPaths(small_linear.MAX_ROWS[torch.float32] * kernel, 0)}
    assert not (tmp_path / "tuning").exists()


def test_the_cache_key_changes_with_dtype_threads_and_cpu():
    shape = Shape(960, 576, "float32", "float32", "kn")
    key = linear_tuning.cache_key(shape, 2, CPU)
    others = [
        linear_tuning.cache_key(Shape(960, 576, "bfloat16", "bfloat16", "nk"), 2, CPU),
        linear_tuning.cache_key(Shape(960, 576, "int8", "float32", "nk"), 2, CPU),
        linear_tuning.cache_key(shape, 1, CPU),
        linear_tuning.cache_key(shape, 2, ("AMD EPYC 9354", CPU[1])),
        linear_tuning.cache_key(shape, 2, (CPU[0], CPU[1] + " amx_bf16")),
        linear_tuning.cache_key(Shape(576, 576, "float32", "float32", "kn"), 2, CPU),
    ]
    assert len({key, *others}) == 7 and linear_tuning.cache_key(shape, 2, CPU) == key


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_real_measurement_times_the_candidates_at_every_bucket(tiny, tmp_path, dtype):
    model = tiny(dtype)
    tables = linear_tuning.tune(model.linears(), dtype, root=tmp_path)
    for shape, table in tables.items():
        assert table.buckets == BUCKETS and set(table.paths) <= set(linear_tuning.candidates(shape))
    assert linear_tuning.candidates(next(iter(tables))) == ((NATIVE, TORCH, "widen") if dtype == torch.bfloat16
                                                            else (NATIVE, TORCH))  # fmt: skip
    with torch.no_grad():  # whatever was chosen computes the layer
        for rows in (1, 5, 40):
            x = torch.randn(rows, 64, dtype=dtype)
            lin = model.linears()[1]
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=tol, atol=tol)


def test_the_flag_defaults_to_the_environment_then_auto(monkeypatch):
    monkeypatch.delenv("RINGSCHED_LINEAR_TUNING", raising=False)
    assert EngineConfig().linear_tuning == "auto"
    monkeypatch.setenv("RINGSCHED_LINEAR_TUNING", "off")
    assert EngineConfig().linear_tuning == "off" and EngineConfig(linear_tuning="auto").linear_tuning == "auto"
    with pytest.raises(ConfigError, match="--linear-tuning"):
        EngineConfig(linear_tuning="fast")


def test_a_layers_shapes_take_the_kernel_together_where_the_one_call_saves_more_than_they_lose():
    shapes = [Shape(n, 64, "float32", "float32", "kn") for n in (128, 64, 192, 96)]
    behind = {64: 10e-6, 128: 80e-6, 192: 30e-6, 96: 20e-6}  # the kernel's lag per shape: 140 us in all
    times = {s: {b: {NATIVE: 100e-6 + behind[s.n] * (1 if b < 16 else 4), TORCH: 100e-6} for b in BUCKETS}
             for s in shapes}  # fmt: skip
    tables = linear_tuning.choose_layers(times, {s: (NATIVE, TORCH) for s in shapes})
    for s in shapes:  # 140 us behind against 4 x 50 us saved up to 8 rows; 560 us behind from 16 rows
        assert [tables[s].path(b) for b in BUCKETS] == [NATIVE] * 4 + [TORCH] * 5
    head = linear_tuning.choose(times[shapes[0]], (NATIVE, TORCH))
    assert {head.path(b) for b in BUCKETS} == {TORCH}  # alone (the lm_head), each shape its fastest


def test_a_path_falling_further_behind_is_retired_and_one_catching_up_is_kept(monkeypatch, tmp_path):
    """Fake timings (us) per path and rows: `slow` is 10x behind at 1 and 2 rows and grows with the rows, so it
    is not timed from 4 rows on (infinity in the table, the cache and the log); `late` starts 10x behind but
    grows slowly (as int8 dequantized then MKL does) and wins at 256 rows: it is timed at every bucket."""
    cost = {"native": lambda r: 10.0 * r, "slow": lambda r: 100.0 * r * r, "late": lambda r: 100.0 + 5.0 * r}
    calls: list[tuple[str, int]] = []

    def fake(paths, x, pieces):
        calls.extend((p, x.shape[0]) for p in paths)
        return {p: cost[p](x.shape[0]) * 1e-6 for p in paths}

    monkeypatch.setattr(linear_timing, "_time_paths", fake)
    layer = small_linear.Linear(8, 4, bias=False)
    shape = Shape(4, 8, "float32", "float32", "nk")
    times = linear_timing.measure_shape(shape, ("native", "slow", "late"), [layer])
    assert {r for p, r in calls if p == "slow"} == {1, 2} and {r for p, r in calls if p == "late"} == set(BUCKETS)
    assert times[4]["slow"] == float("inf") and times[256]["late"] < times[256]["native"]
    assert linear_tuning.choose(times, ("native", "slow", "late")).path(256) == "late"
    path = tmp_path / "t.json"
    linear_tuning.write_times(path, shape, times, CPU, 2)
    assert linear_tuning.read_times(path, ("native", "slow", "late")) == times
    table = linear_tuning.choose(times, ("native", "slow", "late"))
    assert "4 40/-/120" in linear_tuning.describe(table, times, ("native", "slow", "late"))


def test_the_first_touch_of_the_weights_is_charged_to_no_path(monkeypatch):
    """A fresh mmap's page faults (here 1 s on the first call of all) would count as the first path's warm-up, and a
    path whose warm-up is far behind is not timed again: the weights are read once before any path is timed."""
    clock = [0.0]
    cost = {NATIVE: 1e-3, TORCH: 2e-3}  # per call: the kernel is the faster
    touched = []

    def fake_call(path, x, pieces):
        clock[0] += cost[path] + (0.0 if touched else 1.0)
        touched.append(path)

    monkeypatch.setattr(linear_timing, "_call", fake_call)
    monkeypatch.setattr(linear_timing, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    layer = small_linear.Linear(8, 4, bias=False)
    times = linear_timing.measure_shape(Shape(4, 8, "float32", "float32", "nk"), (NATIVE, TORCH), [layer])
    assert all(t == pytest.approx(cost) for t in times.values()), times


@pytest.mark.parametrize("outlier_at", [0, 1, 2])  # the faster path's warm-up, its first timed call, its second
def test_one_30x_outlier_on_the_faster_path_does_not_decide(monkeypatch, outlier_at):
    """A fake clock: the kernel takes 1 ms a call and torch 2 ms, but one of the kernel's calls (another process's
    burst) takes 30x. The kernel is still timed at 1 ms at every bucket, so the choice stays the kernel."""
    clock, calls = [0.0], {NATIVE: 0, TORCH: 0}
    cost = {NATIVE: 1e-3, TORCH: 2e-3}

    def fake_call(path, x, pieces):
        n = calls[path]
        calls[path] += 1
        first_bucket_call = n - 1  # the untimed first touch of the weights is the kernel's call 0
        clock[0] += cost[path] * (30 if path == NATIVE and first_bucket_call == outlier_at else 1)

    monkeypatch.setattr(linear_timing, "_call", fake_call)
    monkeypatch.setattr(linear_timing, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    layer = small_linear.Linear(8, 4, bias=False)
    times = linear_timing.measure_shape(Shape(4, 8, "float32", "float32", "nk"), (NATIVE, TORCH), [layer])
    assert all(t[NATIVE] == pytest.approx(1e-3) and t[NATIVE] < t[TORCH] for t in times.values()), times
