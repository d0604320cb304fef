"""Tensor parallelism as layer types: each knows which part of the whole layer's weight it holds (so the loader
reads only that part) and what it must exchange with the stage's other ranks (so the model code never asks).

A column-parallel linear layer holds a slice of the output features and exchanges nothing: its output is its
slice of the whole output (q/k/v, gate/up). A row-parallel one holds the matching slice of the input features,
so its output is a partial sum that one all-reduce over the group completes (o_proj, down_proj). A stage of
one rank builds the same types over `tp.SoloGroup`, whose all-reduce returns its input: the forward code reads the
same either way. The vocabulary's layers are in `models/vocab.py`.
"""

from __future__ import annotations

import torch
from torch import nn

from ringsched.kernels.small_linear import Linear
from ringsched.models.tp import TPGroup

Part = tuple[int, int]  # (first, count) of the whole layer's features along the split dimension
ReadSlice = tuple[int, int, int]  # (dim, start, stop) of a checkpoint tensor, as `loader._read` takes it


class Sharded:
    """A layer holding features `part` of the `whole` along dimension `split_dim` of its checkpoint weight."""

    split_dim: int = 0
    part: Part = (0, 0)
    whole: int = 0

    def read_slices(self) -> dict[str, ReadSlice]:
        """(dim, start, stop) to read of each of its parameters' checkpoint tensors (none when it holds the
        whole). A column-parallel bias is cut as the output features are."""
        start, count = self.part
        if count == self.whole:
            return {}
        out = {"weight": (self.split_dim, start, start + count)}
        if self.split_dim == 0 and getattr(self, "bias", None) is not None:
            out["bias"] = (0, start, start + count)
        return out


class ColumnParallelLinear(Sharded, Linear):
    """Output features `part` of a `whole`-wide linear layer: this rank's slice of the output, no exchange."""

    def __init__(self, in_features: int, part: Part, whole: int, bias: bool) -> None:
        super().__init__(in_features, part[1], bias=bias)
        self.part, self.whole = part, whole


class RowParallelLinear(Sharded, Linear):
    """Input features `part` of a `whole`-wide linear layer, its output summed over `group`; a bias is read whole
    and kept by the group's first rank alone (zeroed on the others at `prepare`), so the sum adds it once.
    `partial_sum` and `reduce` split the call for a caller that runs the product in pieces and sums the whole once
    (the MLP's row slices)."""

    split_dim = 1

    def __init__(self, part: Part, whole: int, out_features: int, group: TPGroup, bias: bool = False) -> None:
        super().__init__(part[1], out_features, bias=bias)
        self.part, self.whole, self.group = part, whole, group

    def prepare(self) -> None:
        if self.bias is not None and self.group.shard.rank != 0:
            with torch.no_grad():
                self.bias.zero_()
        super().prepare()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(super().forward(x))

    def partial_sum(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's term of the output (the whole output on a stage of one rank)."""
        return super().forward(x)

    def reduce(self, out: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `partial_sum`, in place."""
        return self.group.all_reduce(out)

    @property
    def sums_over_ranks(self) -> bool:
        """Whether a call exchanges anything (false over `SoloGroup`): the one-call native decode runs no
        collectives, so it takes only layers that need none."""
        return self.group.size > 1


def read_slices(model: nn.Module) -> dict[str, ReadSlice]:
    """(dim, start, stop) of the checkpoint tensor each sharded parameter of `model` reads, by parameter name;
    parameters not named are read whole."""
    out: dict[str, ReadSlice] = {}
    for prefix, module in model.named_modules():
        if isinstance(module, Sharded):
            for name, part in module.read_slices().items():
                out[f"{prefix}.{name}" if prefix else name] = part
    return out
