"""The model description ringsched needs, read from a Hugging Face `config.json`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ringsched.weights.families import FAMILIES, SUPPORTED_ARCHITECTURES, MoEConfig, UnsupportedModelError
from ringsched.weights.rope_scaling import RopeConfigError, RopeScaling

__all__ = ["ModelConfig", "MoEConfig", "SUPPORTED_ARCHITECTURES", "UnsupportedModelError", "layer_matmul_params"]
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # bias on the q/k/v projections (Qwen2 always; others with `attention_bias`)
    o_proj_bias: bool = False  # and on o_proj (Llama, Mistral, Qwen3 with `attention_bias`; never Qwen2)
    mlp_bias: bool = False  # bias on gate, up and down (Llama's `mlp_bias`)
    qk_norm: bool = False  # Qwen3: RMSNorm on each head of q and k before rotary
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    rope_scaling: RopeScaling = RopeScaling()
    # The layer type (`models/layer_types.py`): "llama" (pre-norm: Llama, Mistral, Qwen, Phi-3, Mixtral) or "gemma"
    # (sandwich norms `(1 + w)`, the embedding scaled by `embed_scale`)
    family: str = "llama"
    hidden_act: str = "silu"  # the MLP's gate activation: silu (SwiGLU) or gelu_pytorch_tanh (GeGLU)
    layer_types: tuple[str, ...] = ()  # per layer "sliding" (attends to its last `sliding_window` tokens) or "full"
    sliding_window: int = 0
    attn_softcap: float = 0.0  # scores -> cap * tanh(scores / cap) before the softmax (0: none)
    final_softcap: float = 0.0  # the same on the logits
    query_scale: float = 0.0  # the scores' scale (0: head_dim ** -0.5)
    embed_scale: float = 1.0
    local_rope: tuple[float, RopeScaling] | None = None  # (theta, scaling) of sliding layers where it differs
    fused_projections: bool = False  # the checkpoint holds q/k/v as one `qkv_proj`, gate/up as `gate_up_proj`
    moe: MoEConfig | None = None  # a mixture of experts in place of the MLP (in `moe.layers`)

    def __post_init__(self) -> None:
        if self.hidden_act not in ACTIVATIONS:
            raise UnsupportedModelError(
                f"hidden_act {self.hidden_act!r} is not supported; ringsched runs {', '.join(ACTIVATIONS)}"
            )
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"architecture {self.architecture!r} is not supported; ringsched runs "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads {self.num_heads} is not a multiple of num_key_value_heads {self.num_kv_heads}"
            )

    def window(self, layer: int) -> int:
        """The tokens layer `layer` attends to back from each query, itself included (0: all of them)."""
        return self.sliding_window if self.layer_types and self.layer_types[layer] == "sliding" else 0

    @property
    def has_sliding(self) -> bool:
        """Whether some layer slides (its KV then lives in rings: `kv/ring.py`)."""
        return "sliding" in self.layer_types and bool(self.sliding_window)

    @property
    def kv_bytes_per_token_per_layer(self) -> int:
        """Elements (not bytes) of K plus V one token stores in one layer; multiply by the dtype size."""
        return 2 * self.num_kv_heads * self.head_dim

    @classmethod
    def from_dict(cls, cfg: dict) -> ModelConfig:
        archs = cfg.get("architectures") or [cfg.get("model_type", "?")]
        arch = archs[0]
        if arch not in FAMILIES:
            raise UnsupportedModelError(
                f"architecture {arch!r} is not supported; ringsched runs {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        try:
            theta, scaling = RopeScaling.from_config(cfg)
        except RopeConfigError as e:
            raise UnsupportedModelError(str(e)) from None
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        shared = dict(
            architecture=arch,
            num_layers=cfg["num_hidden_layers"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            vocab_size=cfg["vocab_size"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            hidden_act=cfg.get("hidden_act", cfg.get("hidden_activation", "silu")),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            rope_scaling=scaling,
        )
        return cls(**{**shared, **FAMILIES[arch].read(cfg)})

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.exists():
            raise FileNotFoundError(f"{path} does not exist; --model needs a model directory with config.json")
        return cls.from_dict(json.loads(path.read_text()))


def layer_matmul_params(m: ModelConfig, layer: int | None = None) -> int:
    """Weights one token multiplies through in decoder layer `layer`: q, k, v, o, then gate, up and down, or with
    experts the router and the gate, up and down of the `top_k` experts it is routed to. `layer` None: the mean
    over the layers (Qwen3-MoE's dense layers among its sparse ones), rounded down."""
    if layer is None:
        return sum(layer_matmul_params(m, i) for i in range(m.num_layers)) // m.num_layers
    return _attention_params(m) + _ffn_params(m, layer, active=True)


def layer_weight_params(m: ModelConfig, layer: int | None = None) -> int:
    """Weights decoder layer `layer`'s projections hold: as `layer_matmul_params`, but every expert (a step of
    many tokens streams them all)."""
    if layer is None:
        return sum(layer_weight_params(m, i) for i in range(m.num_layers)) // m.num_layers
    return _attention_params(m) + _ffn_params(m, layer, active=False)


def _attention_params(m: ModelConfig) -> int:
    q_out, kv_out = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    return m.hidden_size * (q_out + 2 * kv_out) + q_out * m.hidden_size


def _ffn_params(m: ModelConfig, layer: int, active: bool) -> int:
    if m.moe is None or layer not in m.moe.layers:
        return 3 * m.hidden_size * m.intermediate_size
    experts = m.moe.top_k if active else m.moe.num_experts
    return m.hidden_size * (m.moe.num_experts + 3 * experts * m.moe.intermediate)
