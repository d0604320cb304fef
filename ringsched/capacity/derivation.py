"""The per-token figures the design document derives by hand, for TP = one node's GPUs.

Contract: `derive(model, cluster)` returns a `Derivation`; it is what the planner prints above its table so a
reader can check the arithmetic behind every row (for Llama-3-70B on H100s: 131 GiB, 4 KiB of KV per token
per layer, a 32 KiB seam, 1.84 MB per TP=8 all-reduce, 294 MB per rank per step, 0.65 ms over NVLink against
5.9 ms over 400 Gb/s, and TP's 4.375 MiB per rank per token, 140x the seam).
"""

from __future__ import annotations

from dataclasses import dataclass

from ringsched.capacity import memory, traffic
from ringsched.capacity.cluster import ClusterSpec
from ringsched.capacity.presets import GIB, ModelSpec


@dataclass(frozen=True)
class Derivation:
    tp: int  # the one-node TP the traffic figures are for
    weights_gib: float
    kv_bytes_per_token_per_layer: int  # the whole model's, before any TP split
    kv_bytes_per_token: int  # all layers
    seam_bytes_per_token: float  # hidden_states + residual, unsharded
    seam_bytes_per_token_per_rank: float  # sharded over the TP group
    allreduce_bytes: float  # one all-reduce of [T, d], per rank
    collectives_per_step: int  # 2 per layer
    tp_bytes_per_rank_per_step: float
    tp_ms_intra_node: float  # that traffic over NVLink
    tp_ms_inter_node: float  # the same traffic if it had to cross the inter-node link
    tp_bytes_per_token_per_rank: float
    tp_to_seam_ratio: float  # TP's per-token bytes against one unsharded seam


def derive(model: ModelSpec, cluster: ClusterSpec) -> Derivation:
    tp = min(cluster.gpus_per_node, cluster.gpus)
    d, b, t = model.hidden_size, model.dtype_bytes, cluster.batch_tokens
    ar = traffic.allreduce_bytes(tp, t, d, b)
    collectives = 2 * model.num_layers
    per_step = collectives * ar
    per_token = collectives * traffic.allreduce_bytes(tp, 1, d, b)
    seam = traffic.seam_bytes(1, d, b)
    return Derivation(
        tp=tp,
        weights_gib=memory.total_weight_bytes(model) / GIB,
        kv_bytes_per_token_per_layer=memory.kv_bytes_per_token_per_layer(model),
        kv_bytes_per_token=memory.kv_bytes_per_token(model, 1, model.num_layers),
        seam_bytes_per_token=seam,
        seam_bytes_per_token_per_rank=traffic.seam_bytes(1, d, b, tp),
        allreduce_bytes=ar,
        collectives_per_step=collectives,
        tp_bytes_per_rank_per_step=per_step,
        tp_ms_intra_node=traffic.transfer_ms(per_step, cluster.gpu.intra_node_gb_per_s),
        tp_ms_inter_node=traffic.transfer_ms(per_step, cluster.inter_node_gb_per_s),
        tp_bytes_per_token_per_rank=per_token,
        tp_to_seam_ratio=per_token / seam,
    )
