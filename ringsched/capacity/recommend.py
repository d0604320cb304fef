"""Pick one layout and say why, in one line.

Contract: `recommend(rows, cluster, baseline)` returns a `Recommendation` (row None when nothing fits).

The rule is the design document's conclusion, "TP inside the node, PP across nodes": keep the TP all-reduces
(2 per layer) on the intra-node link when some layout can, since over the inter-node link they cost more than
the compute; among those, take the most concurrent sequences; among layouts within 5% of that, take the lowest
per-token latency (the largest TP), because PP buys no latency.
"""

from __future__ import annotations

from dataclasses import dataclass

from ringsched.capacity import traffic
from ringsched.capacity.cluster import ClusterSpec
from ringsched.capacity.estimate import LayoutRow

NEAR_BEST = 0.95  # layouts with at least this share of the best concurrency count as equal on capacity


@dataclass(frozen=True)
class Recommendation:
    row: LayoutRow | None
    reason: str


def recommend(rows: list[LayoutRow], cluster: ClusterSpec, baseline: LayoutRow | None = None) -> Recommendation:
    fitting = [r for r in rows if r.fits]
    if not fitting:
        return Recommendation(
            None,
            f"no layout of {cluster.gpus} GPUs holds one {cluster.max_model_len}-token sequence: add GPUs, "
            "lower --max-model-len or --reserve-gib, or raise --mem-fraction",
        )
    local = [r for r in fitting if r.tp_link != traffic.INTER]
    pool = local or fitting
    best = max(r.concurrent_sequences for r in pool)
    near = [r for r in pool if r.concurrent_sequences >= NEAR_BEST * best]
    pick = min(near, key=lambda r: (r.ideal_token_latency_ms + r.comm_ms_per_step, r.pp))
    return Recommendation(pick, _reason(pick, cluster, baseline, bool(local)))


def _reason(row: LayoutRow, cluster: ClusterSpec, baseline: LayoutRow | None, local: bool) -> str:
    parts = [f"{row.concurrent_sequences} sequences of {cluster.max_model_len} tokens"]
    if row.concurrency_vs_one_node is not None and baseline is not None:
        parts[0] += f" ({row.concurrency_vs_one_node:+.0%} over TP={baseline.tp} on one node)"
    parts.append(f"{row.ideal_token_latency_ms:.2f} ms per token from weight bandwidth")
    if row.tp > 1:
        where = "stay inside a node" if row.tp_link == traffic.INTRA else "cross nodes (nothing else fits)"
        parts.append(f"TP all-reduces {where}, {row.comm_ms_per_step:.2f} ms per step")
    elif not local:
        parts.append("every layout's TP crosses nodes")
    if row.pp > 1:
        seam_kib = row.seam_bytes_per_rank_per_step / cluster.batch_tokens / 1024
        parts.append(f"the seams carry {seam_kib:g} KiB per token per rank; keep at least {row.pp} batches in flight")
    if row.cp > 1:
        parts.append(f"each of a stage's {row.cp} CP ranks holds 1/{row.cp} of every sequence's KV")
    name = f"TP={row.tp} x PP={row.pp}" + (f" x CP={row.cp}" if row.cp > 1 else "")
    return f"{name}: " + "; ".join(parts)
