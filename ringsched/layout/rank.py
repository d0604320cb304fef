"""A rank's place in the layout, passed in as a value (never looked up from a global rank): `StageInfo` (its
stage in the ring and the layers it holds) and `RankInfo` (its coordinates and groups), made by `rank_infos`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StageInfo:
    rank: int
    size: int
    start_layer: int = 0
    end_layer: int = 0  # exclusive

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"stage rank {self.rank} is outside [0, {self.size})")
        if self.end_layer < self.start_layer:
            raise ValueError(f"stage {self.rank}: empty or negative layer range [{self.start_layer}, {self.end_layer})")

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    @property
    def next(self) -> int:
        return (self.rank + 1) % self.size

    @property
    def prev(self) -> int:
        return (self.rank - 1) % self.size

    @property
    def num_layers(self) -> int:
        return self.end_layer - self.start_layer

    def owns(self, layer: int) -> bool:
        return self.start_layer <= layer < self.end_layer


@dataclass(frozen=True)
class Layout:
    """How the ranks are arranged: `pp_size` stages, each a group of `tp_size x cp_size` ranks (tensor and
    context parallel inside a stage), over `nnodes` nodes."""

    pp_size: int
    tp_size: int = 1
    cp_size: int = 1
    nnodes: int = 1

    def __post_init__(self) -> None:
        for name in ("pp_size", "tp_size", "cp_size", "nnodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.world_size % self.nnodes:
            raise ValueError(f"{self.world_size} ranks do not split evenly over {self.nnodes} nodes")
        if self.nnodes > 1 and self.ranks_per_node % (self.tp_size * self.cp_size):
            raise ValueError("a stage's ranks must sit on one node (tensor and context parallelism stay inside it)")

    @property
    def world_size(self) -> int:
        return self.pp_size * self.tp_size * self.cp_size

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    def rank_of(self, pp: int, tp: int = 0, cp: int = 0) -> int:
        """Global rank of coordinates (pp, tp, cp): tensor parallel innermost (its all-reduces are the most
        frequent), then context parallel, then the pipeline, so a stage's ranks are consecutive on one node."""
        return (pp * self.cp_size + cp) * self.tp_size + tp


@dataclass(frozen=True)
class RankInfo:
    """One rank's place in the layout: its coordinates, node, the layers of its stage, and the ranks it shares
    each group with (`pp_group`: its pipeline, the same tp and cp index in every stage; `tp_group` and `cp_group`:
    ranks of its stage; `stage_group`: all ranks of its stage). Passed in; nothing asks torch.distributed."""

    rank: int
    pp: int
    tp: int
    cp: int
    node: int
    local_rank: int
    stage: StageInfo
    pp_group: tuple[int, ...]
    tp_group: tuple[int, ...]
    cp_group: tuple[int, ...]
    stage_group: tuple[int, ...]

    @property
    def decides(self) -> bool:
        """Stage 0's first rank: the only one that plans; within a stage its plan is broadcast."""
        return self.rank == 0

    @property
    def leads_stage(self) -> bool:
        return self.tp == 0 and self.cp == 0


def rank_infos(layout: Layout, layer_counts: list[int]) -> list[RankInfo]:
    """Every rank of `layout`, in rank order, with stage `k` holding `layer_counts[k]` layers."""
    if len(layer_counts) != layout.pp_size:
        raise ValueError(f"{len(layer_counts)} layer counts for {layout.pp_size} stages")
    starts = [sum(layer_counts[:k]) for k in range(layout.pp_size)]
    out = []
    for pp in range(layout.pp_size):
        stage = StageInfo(pp, layout.pp_size, starts[pp], starts[pp] + layer_counts[pp])
        stage_group = tuple(layout.rank_of(pp, t, c) for c in range(layout.cp_size) for t in range(layout.tp_size))
        for cp in range(layout.cp_size):
            for tp in range(layout.tp_size):
                rank = layout.rank_of(pp, tp, cp)
                out.append(
                    RankInfo(
                        rank=rank,
                        pp=pp,
                        tp=tp,
                        cp=cp,
                        node=rank // layout.ranks_per_node,
                        local_rank=rank % layout.ranks_per_node,
                        stage=stage,
                        pp_group=tuple(layout.rank_of(p, tp, cp) for p in range(layout.pp_size)),
                        tp_group=tuple(layout.rank_of(pp, t, cp) for t in range(layout.tp_size)),
                        cp_group=tuple(layout.rank_of(pp, tp, c) for c in range(layout.cp_size)),
                        stage_group=stage_group,
                    )
                )
    return sorted(out, key=lambda r: r.rank)


def node_rank_infos(layout: Layout, layer_counts: list[int], node: int) -> list[RankInfo]:
    """The ranks one node runs, in local order."""
    return [r for r in rank_infos(layout, layer_counts) if r.node == node]
