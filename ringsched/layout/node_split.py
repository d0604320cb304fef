"""A layer split over stages that are not alike: each stage's measured time per layer and the memory its node
gives it (plain numbers, no processes).

Contract: `balanced_split(num_layers, cost, caps)` is the split (every stage >= 1 layer, stage k at most
`caps[k]`) whose slowest stage `cost(k, n)` is fastest, ties to the most even; `split_over_nodes(num_layers, nodes,
weights)` prices each stage by its node's measurements (`NodeSpec`), caps it by the memory its node gives it
(`StageBytes`), and raises `SplitError` naming each node's shortfall when the nodes together cannot hold the
model. Both are pure: node 0 decides once and publishes the counts.

The memory a stage needs for n layers is its weights (n layers, the embedding on the first stage, the final norm
and lm_head on the last) and its KV: `--kv-cache-memory` as the node gave it in bytes (a pool of that size
whatever its layers), or, given as a fraction of free memory, at least one request of the full context over its
n layers. A node's memory is shared evenly by the stages it runs, as the KV budget is.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass

GIB = 2**30


class SplitError(ValueError):
    """No split fits: the message names each node's shortfall and the flags that change it."""


def balanced_split(num_layers: int, cost: Callable[[int, int], float], caps: list[int]) -> list[int]:
    """Dynamic programming over (stages placed, layers placed): best[k][n] is the best (slowest stage, sum of
    squared counts, counts) for the first k stages holding the first n layers. Raises `SplitError` when the caps
    leave no split."""
    pp = len(caps)
    if not 1 <= pp <= num_layers:
        raise ValueError(f"cannot cut {num_layers} layers into {pp} stages")
    best: list[dict[int, tuple[float, int, list[int]]]] = [{0: (0.0, 0, [])}]
    for k in range(pp):
        row: dict[int, tuple[float, int, list[int]]] = {}
        for placed, (slowest, sq, counts) in best[k].items():
            left_after = pp - k - 1  # stages still to fill, one layer each at least
            for n in range(1, min(caps[k], num_layers - placed - left_after) + 1):
                cand = (max(slowest, cost(k, n)), sq + n * n, counts + [n])
                if placed + n not in row or _better(cand, row[placed + n]):
                    row[placed + n] = cand
        best.append(row)
    if num_layers not in best[pp]:
        raise SplitError(f"no split of {num_layers} layers fits stages holding at most {caps} layers")
    return best[pp][num_layers][2]


def balance_loss(stage_ms: list[float]) -> float:
    """Throughput lost against a perfect balance (every stage taking the mean): 1 - mean / slowest."""
    return 1.0 - statistics.fmean(stage_ms) / max(stage_ms)


def _better(a: tuple[float, int, list[int]], b: tuple[float, int, list[int]]) -> bool:
    # Differences under 0.1% are measurement noise: prefer the more even split then.
    if abs(a[0] - b[0]) > 1e-3 * max(a[0], b[0]):
        return a[0] < b[0]
    return a[1] < b[1]


@dataclass(frozen=True)
class StageBytes:
    """Bytes a stage holds, over all its ranks: `layer` per decoder layer, `first` (the embedding) on the first
    stage, `last` (final norm, lm_head) on the last; KV `kv_fixed` per stage plus `kv_layer` per layer."""

    layer: float
    first: float
    last: float
    kv_layer: float = 0.0
    kv_fixed: float = 0.0

    def need(self, k: int, pp: int, n: int) -> float:
        fixed = self.kv_fixed + (self.first if k == 0 else 0.0) + (self.last if k == pp - 1 else 0.0)
        return fixed + n * (self.layer + self.kv_layer)

    def most_layers(self, k: int, pp: int, memory: float | None, num_layers: int) -> int:
        """The most layers stage k of `pp` holds in `memory` bytes (None: no limit)."""
        if memory is None:
            return num_layers
        room = memory - self.need(k, pp, 0)
        return max(min(int(room // (self.layer + self.kv_layer)), num_layers), 0)


@dataclass(frozen=True)
class NodeSpec:
    """One node as it measured itself: a layer's milliseconds on each of its stages' cores, the embedding's on its
    first stage's and the head's on its last stage's, and the bytes it gives the model (None: not limited)."""

    node: int
    layer_ms: tuple[float, ...]
    embed_ms: float
    head_ms: float
    memory: float | None = None

    @property
    def stages(self) -> int:
        return len(self.layer_ms)


def stage_costs(nodes: list[NodeSpec]) -> Callable[[int, int], float]:
    """Stage k's time with n layers: its node's layer time, the first node's embedding, the last node's head."""
    layer_ms = [ms for nd in nodes for ms in nd.layer_ms]
    pp = len(layer_ms)

    def cost(k: int, n: int) -> float:
        return n * layer_ms[k] + (nodes[0].embed_ms if k == 0 else 0.0) + (nodes[-1].head_ms if k == pp - 1 else 0.0)

    return cost


def stage_caps(nodes: list[NodeSpec], weights: StageBytes, num_layers: int) -> list[int]:
    pp = sum(nd.stages for nd in nodes)
    caps, k = [], 0
    for nd in nodes:
        share = None if nd.memory is None else nd.memory / nd.stages
        for _ in range(nd.stages):
            caps.append(weights.most_layers(k, pp, share, num_layers))
            k += 1
    return caps


def split_over_nodes(num_layers: int, nodes: list[NodeSpec], weights: StageBytes) -> list[int]:
    """The fastest split the nodes' memory allows; `SplitError` naming each node's shortfall when none does."""
    caps = stage_caps(nodes, weights, num_layers)
    if sum(caps) >= num_layers and min(caps) >= 1:
        return balanced_split(num_layers, stage_costs(nodes), caps)
    raise SplitError(shortfall(num_layers, nodes, weights, caps))


def shortfall(num_layers: int, nodes: list[NodeSpec], weights: StageBytes, caps: list[int]) -> str:
    pp = len(caps)
    even = [num_layers // pp + (k >= pp - num_layers % pp) for k in range(pp)]
    parts, k = [], 0
    for nd in nodes:
        ks = range(k, k + nd.stages)
        need = sum(weights.need(j, pp, even[j]) for j in ks)
        have = "no limit" if nd.memory is None else f"{nd.memory / GIB:.2f} GiB"
        short = 0.0 if nd.memory is None else max(need - nd.memory, 0.0)
        parts.append(
            f"node {nd.node}: {have} for {nd.stages} stage(s), holds at most {sum(caps[j] for j in ks)} "
            f"layers; an even share ({sum(even[j] for j in ks)} layers) needs {need / GIB:.2f} GiB"
            + (f", {short / GIB:.2f} GiB short" if short else "")
        )
        k += nd.stages
    return (
        f"the nodes together cannot hold the model's {num_layers} layers with their weights and KV: "
        + "; ".join(parts)
        + ". Give a node more (--node-memory), a smaller --kv-cache-memory, or more nodes"
    )


def describe(counts: list[int], nodes: list[NodeSpec], weights: StageBytes | None = None) -> str:
    """One line per node: its measured layer time, memory, its stages' layers; then the predicted stage times."""
    cost, pp, k = stage_costs(nodes), len(counts), 0
    lines = []
    for nd in nodes:
        ks = list(range(k, k + nd.stages))
        mem = "memory not limited" if nd.memory is None else f"{nd.memory / GIB:.2f} GiB"
        if weights is not None and nd.memory is not None:
            mem += f" ({sum(weights.need(j, pp, counts[j]) for j in ks) / GIB:.2f} GiB used)"
        lines.append(
            f"node {nd.node}: layer {', '.join(f'{ms:.2f}' for ms in nd.layer_ms)} ms, {mem}: "
            f"layers {[counts[j] for j in ks]}"
        )
        k += nd.stages
    ms = [cost(j, n) for j, n in enumerate(counts)]
    lost = balance_loss(ms)
    lines.append(
        f"predicted stage times {[round(t, 2) for t in ms]} ms; {100 * lost:.1f}% lost against a perfect balance"
    )
    return "\n".join(lines)
