"""A sparse mixture of experts in place of a layer's MLP (Mixtral, Qwen3-MoE): a linear router picks each token's
`top_k` experts, each a SwiGLU MLP, and the token's output is their outputs weighted by the router.

Routing is transformers' own: softmax over the router's logits in float32, the top k kept (renormalised over them
when `norm_topk_prob`; Mixtral always), the weights cast back to the activations' dtype. A step groups its
(token, expert) pairs by expert, runs each expert that has tokens once on its rows and scatter-adds the weighted
results, so the Python work is per expert, never per token.

Under tensor parallelism each rank holds its slice of every expert's intermediate (`TPShard.expert_intermediate`:
gate and up column-parallel, down row-parallel) and the router whole, so every rank routes alike without an
exchange; each expert's down projection gives a partial sum, and the layer sums them over the ranks once, after
every expert (`RowParallelLinear.reduce`): one all-reduce per layer, as for the dense MLP. The parameter names are
the checkpoint's per-expert ones (`block_sparse_moe.experts.3.w1.weight`, `mlp.experts.3.gate_proj.weight`).
"""

from __future__ import annotations

import torch
from torch import nn

from ringsched.kernels.small_linear import Linear
from ringsched.models.decoder_layer import ACTIVATIONS, prepare_fused, prepare_single
from ringsched.models.parallel_linear import ColumnParallelLinear, RowParallelLinear
from ringsched.models.tp import SoloGroup, TPGroup
from ringsched.weights.model_config import ModelConfig


class Expert(nn.Module):
    """One expert's SwiGLU MLP, or the rank's rows of it: gate and up column-parallel, down row-parallel, each a
    submodule named as the checkpoint names it (`names`: gate, up, down)."""

    def __init__(self, cfg: ModelConfig, group: TPGroup, names: tuple[str, str, str]) -> None:
        super().__init__()
        part, hidden, inter = group.shard.expert_intermediate(cfg), cfg.hidden_size, cfg.moe.intermediate
        self.names = names
        self.add_module(names[0], ColumnParallelLinear(hidden, part, inter, bias=False))
        self.add_module(names[1], ColumnParallelLinear(hidden, part, inter, bias=False))
        self.add_module(names[2], RowParallelLinear(part, inter, hidden, group))
        self.__dict__["gate_up"] = None  # `fuse_linears` of gate/up once the weights are in (not a submodule)
        self.act = ACTIVATIONS[cfg.hidden_act]

    @property
    def gate(self) -> ColumnParallelLinear:
        return getattr(self, self.names[0])

    @property
    def up(self) -> ColumnParallelLinear:
        return getattr(self, self.names[1])

    @property
    def down(self) -> RowParallelLinear:
        return getattr(self, self.names[2])

    def prepare_linears(self, quantization: str) -> None:
        self.__dict__["gate_up"] = prepare_fused([self.gate, self.up], quantization)
        prepare_single(self.down, quantization, down=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum of the expert's output for rows `x` [n, hidden] (not yet summed over ranks)."""
        if self.gate_up is not None:
            h, up = self.gate_up(x).split(self.gate.out_features, dim=-1)
        else:
            h, up = self.gate(x), self.up(x)
        return self.down.partial_sum(self.act(h).mul_(up))


class SparseMoE(nn.Module):
    """The rank's shard of layer's mixture of experts over `group` (`cfg` is the whole model's, `cfg.moe` its
    experts): `gate`, the router (replicated, no bias, [num_experts, hidden]), and `experts`, each holding the
    rank's rows of every expert. `forward` takes `[T, hidden]` and returns the whole `[T, hidden]` output, summed
    over the ranks."""

    def __init__(self, cfg: ModelConfig, group: TPGroup | None = None) -> None:
        super().__init__()
        assert cfg.moe is not None, "SparseMoE of a model without experts"
        group = group if group is not None else SoloGroup()
        moe = cfg.moe
        self.num_experts, self.top_k, self.norm_topk_prob = moe.num_experts, moe.top_k, moe.norm_topk_prob
        self.gate = Linear(cfg.hidden_size, moe.num_experts, bias=False)
        self.experts = nn.ModuleList(Expert(cfg, group, moe.names[1:]) for _ in range(moe.num_experts))

    def linears(self) -> list[Linear]:
        """The router and each expert's fused gate/up and down (after `prepare_linears`)."""
        return [self.gate] + [lin for e in self.experts for lin in (e.gate_up, e.down)]

    def fusion_groups(self, prefix: str) -> list[list[tuple[str, nn.Linear]]]:
        """Each expert's gate and up, fused as the dense MLP's are (`prefix`: the block's, `model.layers.3.mlp`)."""
        return [
            [(f"{prefix}.experts.{i}.{e.names[0]}", e.gate), (f"{prefix}.experts.{i}.{e.names[1]}", e.up)]
            for i, e in enumerate(self.experts)
        ]

    def prepare_linears(self, quantization: str) -> None:
        """After the weights are in: fuse each expert's gate/up and quantise the experts (`int8`); the router stays
        in the model's dtype (it is small, and a rounded logit can change which experts a token takes)."""
        for expert in self.experts:
            expert.prepare_linears(quantization)
        self.gate.prepare()

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`([T, top_k] weights in x's dtype, [T, top_k] expert ids)` of rows `x` [T, hidden], as transformers
        routes: softmax in float32 over every expert, the top k, renormalised over them when `norm_topk_prob`."""
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights /= weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        out = x.new_zeros(x.shape[0], x.shape[1])
        # The (token, expert) pairs grouped by expert: a stable sort keeps each expert's rows in token order.
        flat = ids.view(-1)
        order = torch.argsort(flat, stable=True)
        rows, pair_weights = order // self.top_k, weights.view(-1)[order]
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        start = 0
        for expert, n in zip(self.experts, counts, strict=True):
            if n:
                idx = rows[start : start + n]
                out.index_add_(0, idx, expert(x[idx]).mul_(pair_weights[start : start + n, None]))
                start += n
        return self.experts[0].down.reduce(out)  # one sum over the ranks, after every expert
