"""Which layer type builds each decoder layer of a model, chosen once from its config (`ModelConfig.family`, `moe`):
the pre-norm layer (`decoder_layer.DecoderLayer`: Llama, Mistral, Qwen, Phi-3, and with experts Mixtral and
Qwen3-MoE) or Gemma's sandwich-norm layer (`gemma.GemmaDecoderLayer`); a dense MLP or a mixture of experts
(`moe.SparseMoE`); the stage's rotary tables, one per RoPE the model uses (Gemma 3's sliding layers have their own).
"""

from __future__ import annotations

from torch import nn

from ringsched.models.decoder_layer import DecoderLayer
from ringsched.models.gemma import GemmaDecoderLayer, GemmaRMSNorm
from ringsched.models.rmsnorm import RMSNorm
from ringsched.models.rope import Rotary
from ringsched.models.tp import TPGroup
from ringsched.weights.model_config import ModelConfig

LAYER_TYPES: dict[str, type[DecoderLayer]] = {"llama": DecoderLayer, "gemma": GemmaDecoderLayer}
NORMS: dict[str, type[RMSNorm]] = {"llama": RMSNorm, "gemma": GemmaRMSNorm}


def final_norm(cfg: ModelConfig) -> RMSNorm:
    """The norm after the last layer, of the family's kind."""
    return NORMS[cfg.family](cfg.hidden_size, cfg.rms_norm_eps)


class Rotaries:
    """The stage's rotary tables: one shared by every layer of a RoPE (a table per layer was 60 MiB for SmolLM2)."""

    def __init__(self, cfg: ModelConfig) -> None:
        self.cfg = cfg
        self.full = Rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.local = Rotary(cfg.head_dim, *cfg.local_rope) if cfg.local_rope is not None else self.full

    def of(self, layer: int) -> Rotary:
        return self.local if self.cfg.window(layer) else self.full


def build_layer(cfg: ModelConfig, layer: int, rotaries: Rotaries, group: TPGroup) -> nn.Module:
    """Decoder layer `layer` (the rank's shard of it over `group`)."""
    kind = LAYER_TYPES[cfg.family]
    if cfg.moe is not None and layer in cfg.moe.layers:
        from ringsched.models.moe import SparseMoE

        return kind(cfg, rotaries.of(layer), group, layer, ffn=SparseMoE(cfg, group), ffn_name=cfg.moe.names[0])
    return kind(cfg, rotaries.of(layer), group, layer)
