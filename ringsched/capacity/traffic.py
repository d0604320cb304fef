"""Bytes each rank sends per decode step, and which link carries them.

Contract: pure functions. Ranks are laid out the way vLLM names its workers (Worker_PP0_TP0 ... PP1_TP7), with
a stage's CP ranks between: global rank = (stage * CP + cp_rank) * TP + tp_rank, and nodes are filled in rank
order, so a TP group sits inside one node whenever it fits in one, a stage's CP x TP ranks next, and the
pipeline seams are what cross nodes.

Traffic model (the design document's): a TP ring all-reduce sends 2 (N-1)/N of the tensor out of every
rank, two per layer (after o_proj, after down_proj) on [T, d]; a seam sends hidden_states plus the un-added
residual, 2 T d b bytes, sharded across the TP group (each rank sends 1/TP over its own link, the receiving
node all-gathers it). Context parallelism: in decode every rank of a CP group attends over its share of each
sequence's KV and the partial outputs (float32, plus one LSE per head) are all-gathered, one per layer; in
prefill each rank's K/V block of a chunk goes round the CP ring, CP - 1 hops per layer. A transfer takes bytes
/ per-direction bandwidth of the link it crosses; latencies and synchronisation are not modelled.
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


def cp_decode_bytes(cp: int, tokens: int, heads_per_rank: int, head_dim: int) -> float:
    """Bytes one rank sends per layer to merge a decode step's attention across its CP group: its partial
    output and LSE of every row (float32), all-gathered: (CP-1) x T x h x (d_h + 1) x 4."""
    return (cp - 1) * tokens * heads_per_rank * (head_dim + 1) * 4


def cp_prefill_bytes_per_token(cp: int, kv_heads_per_rank: int, head_dim: int, dtype_bytes: int) -> float:
    """Bytes one rank sends per layer per prompt token in ring attention: its 1/CP of the chunk's K/V, passed
    on CP - 1 times."""
    return (cp - 1) / cp * 2 * kv_heads_per_rank * head_dim * dtype_bytes


def _node(rank: int, gpus_per_node: int) -> int:
    return rank // gpus_per_node


def tp_crosses_nodes(tp: int, pp: int, gpus_per_node: int, cp: int = 1) -> bool:
    """Whether any TP group spans two nodes (then its all-reduces ride the inter-node link)."""
    firsts = [g * tp for g in range(pp * cp)]
    return any(_node(f, gpus_per_node) != _node(f + tp - 1, gpus_per_node) for f in firsts)


def cp_crosses_nodes(tp: int, pp: int, cp: int, gpus_per_node: int) -> bool:
    """Whether any CP group (one stage's ranks of one TP rank) spans two nodes."""
    return any(
        _node(stage * cp * tp + t, gpus_per_node) != _node((stage * cp + cp - 1) * tp + t, gpus_per_node)
        for stage in range(pp)
        for t in range(tp)
    )


def seam_crosses_nodes(stage: int, tp: int, gpus_per_node: int, cp: int = 1) -> bool:
    """Whether any rank of `stage` sends to its peer of `stage + 1` on another node."""
    group = tp * cp
    return any(
        _node(stage * group + r, gpus_per_node) != _node((stage + 1) * group + r, gpus_per_node) for r in range(group)
    )


def transfer_ms(num_bytes: float, gb_per_s: float) -> float:
    """Milliseconds to push `num_bytes` over a link of `gb_per_s` decimal GB/s in one direction."""
    return num_bytes / (gb_per_s * 1e9) * 1e3
