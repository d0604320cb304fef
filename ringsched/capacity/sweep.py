"""One planning run: the layouts asked for (or all of them), the baseline, the derivation, the pick.

Contract: `make_layouts(model, cluster, tp, pp, partition, cp)` returns a `Plan`. With neither `tp` nor `pp` it
sweeps every TP x PP = --gpus / CP (for each CP asked for, default 1) and keeps those that fit; with either or
both it plans exactly those layouts (a layout that does not fit is kept, with `fits` false) and raises
`CapacityError` on one that cannot exist.
"""

from __future__ import annotations

from dataclasses import dataclass

from ringsched.capacity.derivation import Derivation, derive
from ringsched.capacity.estimate import (
    ClusterSpec,
    LayoutRow,
    candidate_layouts,
    layout_row,
    one_node_baseline,
    with_baseline,
)
from ringsched.capacity.presets import CapacityError, ModelSpec
from ringsched.capacity.recommend import Recommendation, recommend


@dataclass(frozen=True)
class Plan:
    model: ModelSpec
    cluster: ClusterSpec
    derivation: Derivation
    rows: list[LayoutRow]
    skipped: list[tuple[int, int, int, str]]  # (tp, pp, cp, why) of swept layouts left out
    baseline: LayoutRow | None  # TP = gpus-per-node alone on one node
    recommendation: Recommendation


def make_layouts(
    model: ModelSpec,
    cluster: ClusterSpec,
    tp: list[int] | None = None,
    pp: list[int] | None = None,
    partition: str | list[int] | None = None,
    cp: list[int] | None = None,
) -> Plan:
    baseline = one_node_baseline(model, cluster)
    rows, skipped = [], []
    for c in cp or [1]:
        if c < 1 or cluster.gpus % c:
            raise CapacityError(f"--cp {c} does not divide --gpus {cluster.gpus}; TP x PP x CP must equal --gpus")
        if tp is None and pp is None:
            more, left_out = candidate_layouts(model, cluster, partition, c)
            rows, skipped = rows + more, skipped + left_out
        else:
            pairs = explicit_layouts(cluster.gpus // c, tp, pp)
            rows += [layout_row(model, cluster, t, p, partition, c) for t, p in pairs]
    rows = with_baseline(rows, baseline)
    rec = recommend(rows, cluster, baseline)
    return Plan(model, cluster, derive(model, cluster), rows, skipped, baseline, rec)


def explicit_layouts(gpus: int, tp: list[int] | None, pp: list[int] | None) -> list[tuple[int, int]]:
    """Pair --tp and --pp values; a missing side is --gpus divided by the other."""
    if tp is not None and pp is not None:
        if len(tp) != len(pp):
            raise CapacityError(
                f"--tp has {len(tp)} values but --pp has {len(pp)}; give one PP per TP or only one flag"
            )
        return list(zip(tp, pp, strict=True))
    given, flag = (tp, "--tp") if tp is not None else (pp, "--pp")
    assert given is not None
    for v in given:
        if v < 1 or gpus % v:
            raise CapacityError(f"{flag} {v} does not divide --gpus {gpus}; TP x PP must equal --gpus")
    pairs = [(v, gpus // v) for v in given]
    return pairs if flag == "--tp" else [(p, t) for t, p in pairs]
