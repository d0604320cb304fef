"""Each linear layer's path chosen by measurement on the CPU at hand (`--linear-tuning auto`, the default).

After its weights are in, a stage times the paths that apply to each projection shape it holds (its fused q/k/v
and gate/up, o_proj, down_proj, the lm_head; `small_linear.PATHS`: the kernel, torch's MKL/oneDNN, bfloat16
widened to float32, int8 by `_weight_int8pack_mm`; a GGUF weight's kernel or its dequantization) at each row count
of `BUCKETS`, and every layer of that shape takes the fastest path per bucket: a `PathTable`, the strategy
`Linear.forward` consults. A row count between two buckets takes the path of the bucket above (past the last, the
last's): the kernel works in tiles of 4 rows and MKL/oneDNN block rows too, so a call costs about what the bucket
above costs, not the one below. Up to `layer_ops.MAX_ROWS` rows a decoder layer's shapes are chosen together
(`choose_layers`): where every one takes the kernel, a decode step runs whole in one native call
(`kernels/decode_layers.py`, which consults the same tables), which saves `ONE_CALL_CREDIT_S` a call.
How the timings are taken: `kernels/linear_timing.py`.

The timings are cached in `$RINGSCHED_CACHE/tuning/` (`cache_dir.cache_dir()`), one JSON file per CPU model and
flags, dtypes, threads, shape and layout, torch version, kernel source and timing method (`cache_key`): a stage that
finds its file does not measure all again: it times the two paths its timings rank fastest at the smallest bucket
(`linear_timing.still_holds`), and measures the shape again if the first lost by `SCREEN` times, so a measurement
spoiled by another process is not kept for good. Ties go to the order of `PATHS`.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import math
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ringsched.cache_dir import cache_dir
from ringsched.kernels import gguf_linear, layer_ops, native_build, small_linear
from ringsched.kernels.linear_timing import BUCKETS, METHOD, Shape, Times, measure_shape, still_holds
from ringsched.kernels.small_linear import INT8PACK, NATIVE, PATHS, TORCH, WIDEN, Linear

logger = logging.getLogger(__name__)

# What a decoder layer's linear call gains from the one-call decode (`kernels/decode_layers.py`), which runs a step
# only where every linear call is the kernel's. Measured (SmolLM2 float32, 2 threads, Intel AMX host, a step at a
# context of 200, medians of 5): one call 25.5 / 50.1 / 86.6 ms against 31.3 / 58.2 / 95.0 layer by layer at
# 1 / 4 / 16 rows, 5.8-8.4 ms over 30 layers x 4 linear calls: 48-70 us a call; the lower end.
ONE_CALL_CREDIT_S = 50e-6
TUNING_DIR = "tuning"


@dataclass(frozen=True)
class PathTable:
    """The path per row bucket: a call of `rows` rows takes the first bucket at or above it (the last past it)."""

    buckets: tuple[int, ...]
    paths: tuple[str, ...]
    _by_rows: tuple[str, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        assert len(self.buckets) == len(self.paths) > 0 and list(self.buckets) == sorted(self.buckets)
        by_rows = tuple(self.paths[bisect.bisect_left(self.buckets, r)] for r in range(self.buckets[-1] + 1))
        object.__setattr__(self, "_by_rows", by_rows)

    def path(self, rows: int) -> str:
        return self._by_rows[rows] if rows < len(self._by_rows) else self.paths[-1]


def shape_of(lin: Linear, act: torch.dtype) -> Shape:
    w = lin.weight
    n, k = w.shape[0], lin.in_features  # int4: the weight is [N, K/2] bytes
    layout = "kn" if w.dtype == torch.float32 and w.stride() == (1, n) else "nk"
    return Shape(n, k, lin.weight_kind(), str(act).removeprefix("torch."), layout)


def candidates(shape: Shape) -> tuple[str, ...]:
    """The paths that apply to `shape` here, in `PATHS` order."""
    if shape.weight.startswith("gguf-"):
        return (NATIVE, TORCH) if gguf_linear.library() is not None else (TORCH,)
    out = [NATIVE] if small_linear.library() is not None else []
    out.append(TORCH)
    if shape.weight == "bfloat16":
        out.append(WIDEN)
    if shape.weight == "int8" and _int8pack_works(getattr(torch, shape.act)):
        out.append(INT8PACK)
    return tuple(p for p in PATHS if p in out)


def _int8pack_works(act: torch.dtype) -> bool:
    try:
        x, w = torch.ones(1, 64, dtype=act), torch.ones(8, 64, dtype=torch.int8)
        torch._weight_int8pack_mm(x, w, torch.ones(8, dtype=act))
        return True
    except (RuntimeError, AttributeError):
        return False


def cpu_identity() -> tuple[str, str]:
    """(model name, flags) of this CPU, from /proc/cpuinfo (empty where it is missing)."""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        model = ""
    return model, native_build._cpu_flags().split(":", 1)[-1].strip()


def cache_key(shape: Shape, threads: int, cpu: tuple[str, str]) -> str:
    """The cache file's name for `shape` timed on `threads` threads of `cpu` (`cpu_identity()`)."""
    lib = gguf_linear if shape.weight.startswith("gguf-") else small_linear  # the kernel it times
    source = hashlib.sha256(b"".join(f.read_bytes() for f in lib.SOURCES)).hexdigest()
    parts = [
        *cpu,
        shape.n,
        shape.k,
        shape.weight,
        shape.act,
        shape.layout,
        threads,
        torch.__version__,
        source,
        list(BUCKETS),
        METHOD,
    ]
    digest = hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]
    return f"{shape.n}x{shape.k}-{shape.weight}-{shape.act}-{shape.layout}-t{threads}-{digest}"


def choose(times: Times, paths: tuple[str, ...]) -> PathTable:
    """The fastest of `paths` per bucket (ties: the earlier in `paths`)."""
    buckets = tuple(sorted(times))
    return PathTable(buckets, tuple(min(paths, key=lambda p, b=b: (times[b][p], paths.index(p))) for b in buckets))


def choose_layers(times: dict[Shape, Times], paths: dict[Shape, tuple[str, ...]]) -> dict[Shape, PathTable]:
    """The decoder layers' shapes, chosen together: up to `layer_ops.MAX_ROWS` rows every one takes the kernel
    when their kernel times, less `ONE_CALL_CREDIT_S` a call, sum to at most their fastest times (the one-call
    decode needs them all on the kernel); else, and past that, each its fastest."""
    tables = {shape: choose(t, paths[shape]) for shape, t in times.items()}
    if not tables or not all(NATIVE in p for p in paths.values()):
        return tables
    shapes = list(times)
    native = [
        b
        for b in BUCKETS
        if b <= layer_ops.MAX_ROWS
        and sum(times[s][b][NATIVE] for s in shapes) - ONE_CALL_CREDIT_S * len(shapes)
        <= sum(times[s][b][tables[s].path(b)] for s in shapes)
    ]
    return {
        s: PathTable(t.buckets, tuple(NATIVE if b in native else c for b, c in zip(t.buckets, t.paths, strict=True)))
        for s, t in tables.items()
    }


def read_times(path: Path, paths: tuple[str, ...]) -> Times | None:
    """The cached timings, or None when the file is missing, unreadable or lacks a bucket or path."""
    try:
        raw = json.loads(path.read_text())["seconds"]
        times = {int(b): {p: float(t[p]) for p in paths} for b, t in raw.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return times if set(times) == set(BUCKETS) else None


def write_times(path: Path, shape: Shape, times: Times, cpu: tuple[str, str], threads: int) -> None:
    """The timings as JSON (written whole, then renamed: stages starting together may write the same file)."""
    body = {
        "cpu": cpu[0],
        "shape": [shape.n, shape.k],
        "weight": shape.weight,
        "activations": shape.act,
        "layout": shape.layout,
        "threads": threads,
        "torch": torch.__version__,
        "seconds": {str(b): t for b, t in sorted(times.items())},
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
            json.dump(body, f, indent=1)
        os.replace(f.name, path)
    except OSError as e:
        logger.warning("linear tuning: could not write %s (%s); the next start measures again", path, e)


Measure = Callable[[Shape, tuple[str, ...], list[Linear]], Times]
Recheck = Callable[[Shape, tuple[str, ...], list[Linear], Times], bool]


def tune(
    layers: list[Linear],
    act: torch.dtype,
    *,
    measure: Measure = measure_shape,
    recheck: Recheck = still_holds,
    root: Path | None = None,
    threads: int | None = None,
    cpu: tuple[str, str] | None = None,
) -> dict[Shape, PathTable]:
    """Give each of `layers` (CPU, prepared; `act`: the model's dtype) the `PathTable` of its shape, from the
    timings cached under `root` (default `cache_dir()`) or measured there and then (`measure`) and cached; one INFO
    line per shape. Cached timings whose choice fails `recheck` (timed again at the smallest bucket) are measured
    again and the cache rewritten. Returns the tables by shape."""
    root = (root or cache_dir()) / TUNING_DIR
    threads = threads or torch.get_num_threads()
    cpu = cpu or cpu_identity()
    groups: dict[Shape, list[Linear]] = {}
    for lin in layers:
        groups.setdefault(shape_of(lin, act), []).append(lin)
    times, paths, source = {}, {}, {}
    for shape, group in groups.items():
        paths[shape] = candidates(shape)
        file = root / f"{cache_key(shape, threads, cpu)}.json"
        start = time.perf_counter()
        cached = read_times(file, paths[shape])
        if cached is not None and recheck(shape, paths[shape], group, cached):
            times[shape], source[shape] = cached, "cached"
        else:
            times[shape] = measure(shape, paths[shape], group)
            write_times(file, shape, times[shape], cpu, threads)
            again = "" if cached is None else "its cached timings failed a spot check: re-"
            source[shape] = f"{again}measured in {time.perf_counter() - start:.2f} s"
    heads = {s for s, g in groups.items() if g[0].vocab_chunk}  # the head is not in the one call
    tables = choose_layers({s: t for s, t in times.items() if s not in heads}, paths)
    tables |= {s: choose(times[s], paths[s]) for s in heads}
    for shape, group in groups.items():
        for lin in group:
            lin.paths = tables[shape]
        logger.info(
            "linear %s x%d (%s): %s",
            shape.label(),
            len(group),
            source[shape],
            describe(tables[shape], times[shape], paths[shape]),
        )
    return tables


def describe(table: PathTable, times: Times, paths: tuple[str, ...]) -> str:
    """The choice by runs of buckets, then each bucket's microseconds per path: `1-8 native, 16-256 torch (us
    native/torch: 1 95/112, 2 ...)`."""
    runs: list[list] = []  # [first bucket, last bucket, path]
    for b, c in zip(table.buckets, table.paths, strict=True):
        if runs and runs[-1][2] == c:
            runs[-1][1] = b
        else:
            runs.append([b, b, c])
    chosen = ", ".join(f"{lo}-{hi} {c}" if lo != hi else f"{lo} {c}" for lo, hi, c in runs)
    cells = ", ".join(f"{b} " + "/".join(_us(times[b][p]) for p in paths) for b in table.buckets)
    return f"{chosen} (us {'/'.join(paths)}: {cells})"


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:.0f}" if math.isfinite(seconds) else "-"  # "-": retired, not timed


def tune_stage(model, mode: str, act: torch.dtype, **kw) -> None:
    """`--linear-tuning`: `auto` tunes the stage's linear layers (`tune`) and lets its one-call decode follow;
    `off` keeps the fixed thresholds `Linear.prepare` gave (`small_linear.MAX_ROWS`, `WIDEN_ROWS`). Off CPU: off."""
    layers = list(model.linears())
    if mode == "off" or not layers or layers[0].weight.device.type != "cpu":
        return
    tune(layers, act, **kw)
    model.paths_chosen()
