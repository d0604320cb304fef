"""How long each path of a linear layer takes on this CPU, per row bucket (`kernels/linear_tuning.py` chooses from
these timings and caches them).

Each timed call runs the path over distinct weights of the shape (the stage's layers; the lm_head in slices of its
vocabulary) until it has read `STREAM_BYTES` or done `FLOP_BUDGET`: the few-row calls stream many layers' weights as
a step does, not one layer's from a core's cache (a larger last-level cache holds them). First an untimed call over
every weight (its first touch, page faults of a fresh mmap, charged to no path); then per bucket: a warm-up call,
one timed call per path, then `ROUNDS - 1` more, interleaved, for each path unless two of its calls were both over
`SCREEN` times the best; a path's time is its best (processes starting beside the stage only add time); a path whose
warm-up took over twice `SCREEN` times the best's is warmed again, and if still that far behind keeps its warm-up
time and is not timed (one call never leaves a path out: a single outlier cannot decide); one far behind at two
buckets in a row and falling further behind (`retired`) is not timed at the larger buckets.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from ringsched.kernels.small_linear import NATIVE, Linear

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
METHOD = 3  # how the timings are taken, in the cache key: timings cached by an earlier method are taken again
STREAM_BYTES = 64 * 2**20  # weights a timed call reads at least (or all the shape's), as a step streams them
FLOP_BUDGET = 0.25e9  # ... unless a call would do more arithmetic than this: then fewer weights (at least one)
HEAD_SLICE = 8  # vocabulary chunks (`Linear.vocab_chunk`) of an lm_head slice
ROUNDS, SCREEN = 3, 2.0
RETIRE = 2 * SCREEN  # times the best, at two buckets in a row, after which a path is not timed again ...
RETIRE_GROWTH = 1.8  # ... if its time grew by this much from one bucket to the next (twice the rows)

Times = dict[int, dict[str, float]]  # bucket -> path -> seconds per call of one layer


@dataclass(frozen=True)
class Shape:
    """What a linear layer's timings depend on besides the CPU: `[n, k]`, the weight's and activations' dtypes,
    and the weight's layout (`kn`: float32 stored `[in, out]`, `fused_linear.cpu_layout`; else `nk`)."""

    n: int
    k: int
    weight: str
    act: str
    layout: str

    def label(self) -> str:
        acts = "" if self.act == self.weight else f" ({self.act} activations)"
        return f"{self.n}x{self.k} {self.weight} {self.layout}{acts}"


@dataclass(frozen=True)
class Piece:
    """One distinct weight of a shape, as a step calls it: a layer, or an lm_head's vocabulary slice."""

    lin: Linear
    rows: slice  # the lm_head's slice; slice(None): the whole layer
    nbytes: int  # its weight bytes as stored
    values: int  # its weight values (the arithmetic of a row)

    def call(self, path: str, x: torch.Tensor) -> None:
        if self.rows == slice(None):
            self.lin.run(x, path)
        elif path == NATIVE:  # the kernel takes a slice whole; the others `vocab_chunk` rows at a time
            self.lin.run_rows(x, self.rows, path)
        else:  # as `LMHead._chunks` runs it
            chunk = self.lin.vocab_chunk
            for s in range(self.rows.start, self.rows.stop, chunk):
                self.lin.run_rows(x, slice(s, min(s + chunk, self.rows.stop)), path)


def _pieces(layers: list[Linear]) -> list[Piece]:
    """Each distinct weight of the shape: a layer, or an lm_head's `HEAD_SLICE`-chunk slices of its vocabulary."""
    out = []
    for lin in layers:
        row_bytes = lin.weight[0].numel() * lin.weight.element_size()
        if lin.vocab_chunk:
            step = HEAD_SLICE * lin.vocab_chunk
            for s in range(0, lin.weight.shape[0], step):
                rows = slice(s, min(s + step, lin.weight.shape[0]))
                n = rows.stop - rows.start
                out.append(Piece(lin, rows, n * row_bytes, n * lin.in_features))
        else:
            out.append(Piece(lin, slice(None), lin.out_features * row_bytes, lin.out_features * lin.in_features))
    return out


def _call(path: str, x: torch.Tensor, pieces: list[Piece]) -> None:
    for piece in pieces:
        piece.call(path, x)


def measure_shape(shape: Shape, paths: tuple[str, ...], layers: list[Linear]) -> Times:
    """Seconds per call of one layer of each path at each bucket, timed on the layers' own weights; a path
    `retired` at a bucket is not timed at the larger ones (its time there: infinity)."""
    pieces = _pieces(layers)
    per_layer = len(pieces) / len(layers)  # an lm_head is several pieces
    times: Times = {}
    live = paths
    with torch.inference_mode():
        _first_touch(paths[0], shape, pieces)
        for rows in BUCKETS:
            timed = {p: t * per_layer for p, t in _time_bucket(live, shape, pieces, rows).items()}
            times[rows] = {p: timed.get(p, math.inf) for p in paths}
            live = tuple(p for p in live if not retired(p, times))
    return times


def still_holds(shape: Shape, paths: tuple[str, ...], layers: list[Linear], times: Times) -> bool:
    """Whether cached `times` still rank right at the smallest bucket: the two paths they rank fastest there are
    timed again as `measure_shape` times them; False when the first now takes over `SCREEN` times the second's
    (a measurement spoiled by another process's burst, or a machine that changed under the same name), so the
    shape is measured again rather than kept on a bad choice for good."""
    rows = BUCKETS[0]
    ranked = sorted(paths, key=lambda p: (times[rows][p], paths.index(p)))
    if len(ranked) < 2:
        return True
    pieces = _pieces(layers)
    with torch.inference_mode():
        _first_touch(ranked[0], shape, pieces)
        again = _time_bucket(tuple(ranked[:2]), shape, pieces, rows)
    return again[ranked[0]] <= SCREEN * again[ranked[1]]


def _first_touch(path: str, shape: Shape, pieces: list[Piece]) -> None:
    """Every weight read once, untimed: its first touch (a fresh mmap's page faults) would count as the first
    path's warm-up, and a path far behind at its warm-up is not timed again."""
    _call(path, torch.zeros(1, shape.k, dtype=getattr(torch, shape.act)), pieces)


def _time_bucket(paths: tuple[str, ...], shape: Shape, pieces: list[Piece], rows: int) -> dict[str, float]:
    """Seconds per piece of each of `paths` at `rows` rows, over as many pieces as `STREAM_BYTES` and
    `FLOP_BUDGET` allow (`_time_paths`' rounds)."""
    flops = 2 * rows * pieces[0].values
    count = min(len(pieces), math.ceil(STREAM_BYTES / pieces[0].nbytes), max(1, int(FLOP_BUDGET // flops)))
    x = torch.randn(rows, shape.k, dtype=getattr(torch, shape.act))
    return {p: t / count for p, t in _time_paths(paths, x, pieces[:count]).items()}


def retired(path: str, times: Times) -> bool:
    """Whether `path` need not be timed at larger buckets: at each of the last two it took over `RETIRE` times
    the best, and between them its time grew with the rows (by `RETIRE_GROWTH` of their doubling at least) and
    by at least the best's factor, so it stays behind. (Dequantizing int8 then MKL starts far behind but its
    fixed cost grows little, and it wins at many rows: kept.)"""
    if len(times) < 2:
        return False
    prev, last = (times[b] for b in sorted(times)[-2:])
    best_prev, best_last = min(prev.values()), min(last.values())
    behind = prev[path] > RETIRE * best_prev and last[path] > RETIRE * best_last
    return behind and last[path] / prev[path] >= max(best_last / best_prev, RETIRE_GROWTH)


def _timed(path: str, x: torch.Tensor, pieces: list[Piece]) -> float:
    t = time.perf_counter()
    _call(path, x, pieces)
    return time.perf_counter() - t


def _time_paths(paths: tuple[str, ...], x: torch.Tensor, pieces: list[Piece]) -> dict[str, float]:
    # Warm-up: first-call costs (oneDNN's primitives, allocations) stay out of the rounds. A path far behind at its
    # warm-up is warmed once more before it is left out: one call can land on another process's burst (a 30x
    # outlier kept a kernel off a shape for good before).
    warm = {p: _timed(p, x, pieces) for p in paths}
    for p in paths:
        if warm[p] > 2 * SCREEN * min(warm.values()):
            warm[p] = min(warm[p], _timed(p, x, pieces))
    seen: dict[str, list[float]] = {p: [] for p in paths if warm[p] <= 2 * SCREEN * min(warm.values())}
    for rnd in range(ROUNDS):
        best = min(min(v) for v in seen.values()) if rnd else 0.0
        for p in seen:
            if len(seen[p]) >= 2 and min(seen[p]) > SCREEN * best:
                continue  # far behind after two calls: more rounds would not change the choice
            seen[p].append(_timed(p, x, pieces))
    return {p: min(seen[p]) if p in seen else warm[p] for p in paths}  # others' load only adds time
