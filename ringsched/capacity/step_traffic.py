"""What the busiest rank of a layout sends in one decode step of T tokens, over which links, and how long they
take: the traffic columns of a `LayoutRow`."""

from __future__ import annotations

from dataclasses import dataclass

from ringsched.capacity import memory, traffic
from ringsched.capacity.cluster import ClusterSpec
from ringsched.capacity.presets import ModelSpec


@dataclass(frozen=True)
class StepTraffic:
    allreduce_bytes: float
    tp_bytes: float  # the busiest rank's, per step
    seam_bytes: float
    tp_link: str | None
    seam_link: str | None
    ms: float
    cp_bytes: float = 0.0
    cp_prefill_per_token: float = 0.0
    cp_link: str | None = None


def step_traffic(model: ModelSpec, cluster: ClusterSpec, tp: int, counts: list[int], cp: int = 1) -> StepTraffic:
    """What the busiest rank sends in one decode step of T tokens, and how long its links take.

    A rank's TP traffic is its stage's 2 all-reduces per layer; every stage but the last also sends its shard
    of the seam; with CP every layer also all-gathers the partial attention outputs. A step waits for each
    stage's slowest rank in turn, so the row reports the busiest one.
    """
    pp, gpn = len(counts), cluster.gpus_per_node
    intra, inter = cluster.gpu.intra_node_gb_per_s, cluster.inter_node_gb_per_s
    ar = traffic.allreduce_bytes(tp, cluster.batch_tokens, model.hidden_size, model.dtype_bytes)
    seam = traffic.seam_bytes(cluster.batch_tokens, model.hidden_size, model.dtype_bytes, tp)
    heads = max(1, model.num_heads // tp)
    cp_layer = traffic.cp_decode_bytes(cp, cluster.batch_tokens, heads, model.head_dim)
    cp_prefill = traffic.cp_prefill_bytes_per_token(
        cp, memory.kv_heads_per_rank(model, tp), model.head_dim, model.dtype_bytes
    )
    tp_cross = traffic.tp_crosses_nodes(tp, pp, gpn, cp)
    cp_cross = traffic.cp_crosses_nodes(tp, pp, cp, gpn)
    seam_cross = [traffic.seam_crosses_nodes(s, tp, gpn, cp) for s in range(pp - 1)]
    per_stage = []  # (ms, tp bytes, seam bytes, cp bytes)
    for s, layers in enumerate(counts):
        tp_bytes, cp_bytes = 2 * layers * ar, layers * cp_layer
        seam_s = seam if s < pp - 1 else 0.0
        seam_bw = inter if s < pp - 1 and seam_cross[s] else intra
        ms = (
            traffic.transfer_ms(tp_bytes, inter if tp_cross else intra)
            + traffic.transfer_ms(seam_s, seam_bw)
            + traffic.transfer_ms(cp_bytes, inter if cp_cross else intra)
        )
        per_stage.append((ms, tp_bytes, seam_s, cp_bytes))
    ms, tp_bytes, seam_bytes, cp_bytes = max(per_stage)
    return StepTraffic(
        allreduce_bytes=ar,
        tp_bytes=tp_bytes,
        seam_bytes=seam_bytes,
        tp_link=(traffic.INTER if tp_cross else traffic.INTRA) if tp > 1 else None,
        seam_link=(traffic.INTER if any(seam_cross) else traffic.INTRA) if pp > 1 else None,
        ms=ms,
        cp_bytes=cp_bytes,
        cp_prefill_per_token=cp_prefill * max(counts),
        cp_link=(traffic.INTER if cp_cross else traffic.INTRA) if cp > 1 else None,
    )
