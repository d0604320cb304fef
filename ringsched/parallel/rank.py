"""A stage's identity in the ring, passed in as a value (never looked up from a global rank)."""

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
            raise ValueError(
                f"stage {self.rank}: empty or negative layer range [{self.start_layer}, {self.end_layer})"
            )

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
