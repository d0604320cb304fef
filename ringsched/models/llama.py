"""One decoder model class for every stage and every family (`weights/families.py`); each layer is built by its
family's layer type (`models/layer_types.py`).

The layer list is always full length; layers the stage does not own are `MissingLayer` placeholders, so
parameter names (`model.layers.17.self_attn.q_proj.weight`) and layer indices stay global. The embedding
exists only on the first stage; the final norm and the lm_head only on the last. The layers themselves are in
`models/decoder_layer.py`, the embedding and the head in `models/vocab.py`.

The residual add is fused into the next RMSNorm, so between layers (and across a stage seam) the state is
the pair `(hidden_states, residual)`: a non-last stage returns both, a non-first stage takes both in.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from ringsched.attention.paged import ForwardBatch
from ringsched.kernels.decode_layers import DecodeLayers
from ringsched.kernels.small_linear import Linear
from ringsched.layout.rank import StageInfo
from ringsched.models.decoder_layer import DecoderLayer, MissingLayer
from ringsched.models.fused_linear import cpu_layout
from ringsched.models.layer_types import Rotaries, build_layer, final_norm
from ringsched.models.rmsnorm import RMSNorm
from ringsched.models.tp import SoloGroup, TPGroup
from ringsched.models.vocab import lm_head, vocab_embedding
from ringsched.weights.model_config import ModelConfig


class StageModel(nn.Module):
    """The part of a decoder one stage runs (one rank's shard of it under tensor parallelism: `tp`, the stage's
    group; None for a stage of one rank). `state_dict` names are the Hugging Face ones; `cfg` is the whole
    model's. The layers are the tensor-parallel types (`models/parallel_linear.py`, `models/vocab.py`), chosen
    here once: the forward code is the same with and without tensor parallelism."""

    def __init__(self, cfg: ModelConfig, stage: StageInfo, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.cfg, self.stage, self.tp = cfg, stage, tp
        group = tp if tp is not None else SoloGroup()
        self.model = nn.Module()
        if stage.is_first:
            self.model.embed_tokens = vocab_embedding(cfg, group)
        rotaries = Rotaries(cfg)  # shared by the stage's layers
        self.model.layers = nn.ModuleList(
            build_layer(cfg, i, rotaries, group) if stage.owns(i) else MissingLayer() for i in range(cfg.num_layers)
        )
        if stage.is_last:
            self.model.norm = final_norm(cfg)
            self.lm_head = lm_head(cfg, group)

    def forward(
        self,
        batch: ForwardBatch,
        input_ids: torch.Tensor | None = None,
        proxy: dict[str, torch.Tensor] | None = None,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
        layers: range | None = None,
    ) -> dict[str, torch.Tensor] | torch.Tensor:
        """First stage takes `input_ids` [T], others `proxy`. Returns the proxy dict, or on the last stage
        the final-normed hidden states of `batch.logit_rows` ([S, hidden]). `layers`: the held layers to run
        (default all; a flexible cut runs part of them)."""
        if self.stage.is_first:
            hidden, residual = self.model.embed_tokens(input_ids), None
        else:
            assert proxy is not None, "a non-first stage needs the previous stage's proxy tensors"
            hidden, residual = proxy["hidden_states"], proxy["residual"]
        todo = layers if layers is not None else range(self.stage.start_layer, self.stage.end_layer)
        # Every layer of a small decode step in one native call, when the layers are known in advance (a range); a
        # flexible cut decided as the layers run (an iterator) runs them one by one.
        whole = self.__dict__.get("decode_layers")
        if (
            isinstance(todo, range)
            and len(todo)
            and whole is not None
            and whole.usable(batch, hidden, residual, kv_caches)
        ):
            hidden, residual = whole(batch, hidden, residual, kv_caches, todo)
        else:
            for i in todo:
                kv = kv_caches[i - self.stage.start_layer] if kv_caches is not None else None
                hidden, residual = self.model.layers[i](hidden, residual, batch, kv)
        if not self.stage.is_last:
            return {"hidden_states": hidden, "residual": residual}
        # Only the rows that sample need the final norm and the lm_head (a decode step: every row, as they are).
        if not batch.samples_all:
            hidden, residual = hidden[batch.logit_rows], residual[batch.logit_rows]
        return batch.gather_samples(self._final_norm(hidden, residual))

    def _final_norm(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The final residual add and norm: one call of the layers' `step_ops` where their small steps take them
        (a native call on CPU, a Triton launch on a GPU), else torch's."""
        norm, last = self.model.norm, self.__dict__.get("norm_layer")
        small = last is not None and 0 < hidden.shape[0] <= last.small_rows
        if small and hidden.is_contiguous() and residual.is_contiguous():
            return last.step_ops.add_rmsnorm(hidden, residual, norm.weight, norm.eps)[0]
        return norm.add_forward(hidden, residual)[0]

    def one_call(self, batch: ForwardBatch) -> bool:
        """Whether a step of `batch` can run its layers in one native call (`kernels/decode_layers.py`)."""
        whole = self.__dict__.get("decode_layers")
        return whole is not None and whole.takes(batch)

    def lay_out_for_cpu(self) -> StageModel:
        """`cpu_layout` applied to every parameter (models built in place, such as the partition probe's)."""
        for name, p in list(self.named_parameters()):
            laid = cpu_layout(name, p.detach())
            if laid.data_ptr() != p.data_ptr():  # a copy was made: this one is re-laid
                owner, attr = name.rsplit(".", 1)
                setattr(self.get_submodule(owner), attr, nn.Parameter(laid, requires_grad=False))
        return self

    def fusion_groups(self) -> list[list[tuple[str, nn.Linear]]]:
        """(parameter prefix, module) of each group of projections `prepare_linears` fuses: q/k/v and gate/up."""
        layers = enumerate(self.model.layers)
        return [g for i, y in layers if not isinstance(y, MissingLayer) for g in y.fusion_groups(f"model.layers.{i}")]

    def prepare_linears(self, quantization: str = "none") -> StageModel:
        """After the weights are in: fuse each layer's q/k/v and gate/up projections, quantise the projections and
        the lm_head (`int8`, `int4`: `kernels/quantize.py`; `int4` the embedding too), and let every linear layer
        pick its kernel."""
        from ringsched.kernels.quantize import quantize_int8_weight, quantize_linear  # it imports small_linear

        tied = self.stage.is_first and self.stage.is_last and self.model.embed_tokens.weight is self.lm_head.weight
        for layer in self.model.layers:
            if not isinstance(layer, MissingLayer):
                layer.prepare_linears(quantization)
        if self.stage.is_last:
            held = [y for y in self.model.layers if isinstance(y, DecoderLayer) and y.step_ops is not None]
            if held and type(self.model.norm) is RMSNorm:  # the plain norm the step ops compute (Gemma's is not)
                self.__dict__["norm_layer"] = held[-1]  # whose step ops and row limit the final norm follows
            if quantization in ("int8", "int4"):  # the head int8 per row under int4 too: its accuracy matters most
                quantize_linear(self.lm_head)
            self.lm_head.prepare()
        if self.stage.is_first and quantization == "int4":  # tied: one int8 tensor for the head and the embedding
            emb = self.model.embed_tokens
            emb.quantize(*((self.lm_head.weight, self.lm_head.scales) if tied else quantize_int8_weight(emb.weight)))
        self.paths_chosen()
        return self

    def linears(self) -> list[Linear]:
        """The linear layers a step calls: each held layer's q/k/v, o_proj, gate/up and down_proj (after
        `prepare_linears`), and the lm_head on the last stage."""
        out = [lin for y in self.model.layers if not isinstance(y, MissingLayer) for lin in y.linears()]
        return out + [self.lm_head] if self.stage.is_last else out

    def batch_invariant(self) -> list[str]:
        """`--enable-deterministic-inference`: every linear layer takes the kernel, and every layer its native
        elementwise ops, at every row count, so a row's result is the same whichever rows share its step (where
        the kernel does not run, torch's path stays and the names of those layers are returned)."""
        names = {id(m): n for n, m in self.named_modules()}
        left = [names.get(id(lin), "lm_head") for lin in self.linears() if not lin.batch_invariant()]
        for layer in self.model.layers:
            if isinstance(layer, DecoderLayer) and layer.step_ops is not None:
                layer.small_rows = sys.maxsize
        self.paths_chosen()
        return left

    def paths_chosen(self) -> None:
        """Once every linear layer has its paths (`Linear.prepare`, or `kernels/linear_tuning.py` after it): the
        one-call decode (`DecodeLayers`) takes the row counts whose every linear call is the kernel's."""
        self.__dict__["decode_layers"] = DecodeLayers(self)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[S, vocab]` logits of the final hidden states (`LMHead.logits`), whole under tensor parallelism."""
        return self.lm_head.logits(hidden)

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[S]` argmax of the logits, the first on ties, without building them whole (`LMHead.greedy`)."""
        return self.lm_head.greedy(hidden)
