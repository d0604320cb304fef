"""Tensor parallelism inside a stage: the collectives its layers and seams run over the stage's group of ranks
(`TPGroup`); which slice of each weight a rank holds is `TPShard`'s (`weights/tp_shard.py`).

Megatron's split: q/k/v and gate/up are column-parallel (each rank computes its heads, its slice of the
intermediate), o_proj and down_proj row-parallel (each rank's partial sum, then one all-reduce: two per layer).
Attention is split by whole GQA groups while `tp <= num_kv_heads` (as evenly as they go); past that each rank
stores one whole KV head, the one its query heads read (replicated: `tp / num_kv_heads` ranks hold each). The
embedding and the lm_head are split by vocabulary rows: a token's embedding comes from the rank holding its row
(an all-reduce of zeros elsewhere); each rank computes its slice of the logits. The layer types that hold these
slices and run these collectives are in `models/parallel_linear.py` and `models/vocab.py`; a stage of one rank
builds them over `SoloGroup`.
"""

from __future__ import annotations

import torch

from ringsched.comm.shm_group import ShmCollectives
from ringsched.comm.stage_group import StageGroup
from ringsched.weights.tp_shard import TPShard


class TPGroup(StageGroup):
    """The collectives of one rank of a stage's tensor-parallel group (`StageGroup`: counted, through shared
    memory between CPU ranks of a node, else the process group), and the seam's shard and gather."""

    def __init__(self, shard: TPShard, group, shm: ShmCollectives | None = None) -> None:
        super().__init__(shard.rank, shard.size, group, shm, prefix="tp")
        self.shard = shard

    def seam_shard(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's 1/size of a seam tensor (a contiguous view of the flattened tensor, no copy)."""
        flat = t.contiguous().view(-1)
        n = flat.numel() // self.size
        return flat[self.rank * n : (self.rank + 1) * n]

    def seam_gather(self, shard: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        """The whole seam tensor of `shape` from every rank's `seam_shard`, gathered straight into one buffer."""
        return self.gather_into(shard, shard.new_empty(shape))


class SoloGroup(TPGroup):
    """The group of a stage of one rank: every collective returns its input and counts nothing, so the
    parallel layer types (`models/parallel_linear.py`) serve such a stage unchanged."""

    def __init__(self) -> None:
        super().__init__(TPShard(), None)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        return t.unsqueeze(0)
