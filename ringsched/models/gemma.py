"""Gemma 2 and Gemma 3's decoder layer: four RMSNorms of `(1 + w)` around attention and the MLP (after each as well as
before: "sandwich" norms), GeGLU, and (Gemma 3) q/k norms of the same kind. The residual stream crosses layers and
stages as Llama's does, the pair `(hidden_states, residual)`: the norm before each block takes the add.
"""

from __future__ import annotations

import torch

from ringsched.attention.paged import ForwardBatch
from ringsched.models.decoder_layer import MLP, Attention, DecoderLayer
from ringsched.models.rmsnorm import RMSNorm
from ringsched.models.rope import Rotary
from ringsched.models.tp import SoloGroup, TPGroup
from ringsched.weights.model_config import ModelConfig


class GemmaRMSNorm(RMSNorm):
    """`norm(x) * (1 + w)` for the checkpoint's `w`: the weight is held as `1 + w` (added in float32 as it loads, as
    transformers adds it), so the forward is `RMSNorm`'s."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__(dim, eps)
        self._register_load_state_dict_pre_hook(self._plus_one)

    @staticmethod
    def _plus_one(state_dict, prefix, *args) -> None:
        name = prefix + "weight"
        if name in state_dict:
            w = state_dict[name]
            state_dict[name] = (1.0 + w.float()).to(w.dtype)


class GemmaDecoderLayer(DecoderLayer):
    """Decoder layer `layer` of Gemma 2/3 (the rank's shard over `group`)."""

    def __init__(
        self,
        cfg: ModelConfig,
        rotary: Rotary | None = None,
        group: TPGroup | None = None,
        layer: int = 0,
        ffn: torch.nn.Module | None = None,
        ffn_name: str = "mlp",
    ) -> None:
        torch.nn.Module.__init__(self)
        group = group if group is not None else SoloGroup()
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.self_attn = Attention(cfg, rotary, group, layer, norm=GemmaRMSNorm)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.ffn_name = ffn_name
        self.add_module(ffn_name, ffn if ffn is not None else MLP(cfg, group))

    def prepare_linears(self, quantization: str = "none") -> None:
        self.self_attn.prepare_linears(quantization)
        self.ffn.prepare_linears(quantization)  # `step_ops` stays None: the native small step is Llama's layer

    def forward(self, hidden, residual, batch: ForwardBatch, kv):
        h, residual = self.input_layernorm.add_forward(hidden, residual)
        h = self.self_attn(h, batch, kv)
        h = self.post_attention_layernorm(h, out=h)
        h, residual = self.pre_feedforward_layernorm.add_forward(h, residual)
        h = self.ffn(h)
        return self.post_feedforward_layernorm(h, out=h), residual
