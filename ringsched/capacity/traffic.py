"""Bytes each rank sends per decode step, and which link carries them.

Contract: pure functions. Ranks are laid out the way vLLM names its workers (Worker_PP0_TP0 ... PP1_TP7):
global rank = stage * TP + tp_rank, and nodes are filled in rank order, so a TP group sits inside one node
whenever it fits in one, and the pipeline seams are what cross nodes.

Traffic model (the design document's): a TP ring all-reduce sends 2 (N-1)/N of the tensor out of every
rank, two per layer (after o_proj, after down_proj) on [T, d]; a seam sends hidden_states plus the un-added
residual, 2 T d b bytes, sharded across the TP group (each rank sends 1/TP over its own link, the receiving
node all-gathers it). A transfer takes bytes / per-direction bandwidth of the link it crosses; latencies and
synchronisation are not modelled.
"""

from __future__ import annotations

INTRA = "nvlink"  # label for the intra-node link (PCIe on GPUs without NVLink)
INTER = "inter-node"


def allreduce_bytes(tp: int, tokens: int, hidden: int, dtype_bytes: int) -> float:
    """Bytes one rank sends in a ring all-reduce of a [tokens, hidden] tensor: 2 (N-1)/N of it."""
    return 2 * (tp - 1) / tp * tokens * hidden * dtype_bytes


def seam_bytes(tokens: int, hidden: int, dtype_bytes: int, tp: int = 1) -> float:
    """Bytes one rank sends across a stage seam: hidden_states + residual, its 1/TP shard of them."""
    return 2 * tokens * hidden * dtype_bytes / tp


def tp_crosses_nodes(tp: int, pp: int, gpus_per_node: int) -> bool:
    """Whether any TP group spans two nodes (then its all-reduces ride the inter-node link)."""
    return any((stage * tp) // gpus_per_node != (stage * tp + tp - 1) // gpus_per_node for stage in range(pp))


def seam_crosses_nodes(stage: int, tp: int, gpus_per_node: int) -> bool:
    """Whether any rank of `stage` sends to its peer of `stage + 1` on another node."""
    return any(
        (stage * tp + r) // gpus_per_node != ((stage + 1) * tp + r) // gpus_per_node for r in range(tp)
    )


def transfer_ms(num_bytes: float, gb_per_s: float) -> float:
    """Milliseconds to push `num_bytes` over a link of `gb_per_s` decimal GB/s in one direction."""
    return num_bytes / (gb_per_s * 1e9) * 1e3
