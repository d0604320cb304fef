"""What each architecture's config.json says beyond the sizes every decoder shares, read into `ModelConfig`'s
fields: one reader per family, and the config fields each reads (so `checkpoint_check` refuses a field only in a
family that does not honour it).

The fields describe computation, not names: a sliding window per layer, soft-capping, a norm's `(1 + w)`, a
mixture of experts. The layer types (`models/layer_types.py`) are chosen from them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from ringsched.weights.rope_scaling import RopeConfigError, RopeScaling


class UnsupportedModelError(ValueError):
    pass


@dataclass(frozen=True)
class MoEConfig:
    """A mixture of experts in place of the MLP: `num_experts` SwiGLU experts of `intermediate` width, each token
    routed to its `top_k` best by a linear router (softmax over every expert, the top k kept, renormalised over
    them when `norm_topk_prob`). `layers`: the layers that have one (the others have the dense MLP). `names`: the
    checkpoint's module names (block, gate, up, down): Mixtral's `block_sparse_moe`, `w1`, `w3`, `w2`."""

    num_experts: int
    top_k: int
    intermediate: int
    norm_topk_prob: bool
    layers: tuple[int, ...]
    names: tuple[str, str, str, str] = ("mlp", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Family:
    """`read(cfg)`: the `ModelConfig` fields (beyond the shared ones) of a config dict; `reads`: the config
    fields it honours that would otherwise be refused."""

    read: Callable[[dict], dict]
    reads: frozenset[str] = frozenset()


def _layer_types(cfg: dict, derive: Callable[[int], bool]) -> tuple[str, ...]:
    """Per layer "sliding" or "full": the config's `layer_types`, or `derive(i)` (True: sliding) where it has
    none (configs older than transformers' `layer_types`)."""
    n = cfg["num_hidden_layers"]
    given = cfg.get("layer_types")
    if given:
        unknown = sorted(set(given) - {"sliding_attention", "full_attention"})
        if unknown:
            raise UnsupportedModelError(
                f"config.json: layer_types {unknown} are not supported (sliding_attention and full_attention are)"
            )
        return tuple("sliding" if t == "sliding_attention" else "full" for t in given)
    return tuple("sliding" if derive(i) else "full" for i in range(n))


def _window(cfg: dict, types: tuple[str, ...]) -> dict:
    if "sliding" not in types:
        return {}
    window = cfg.get("sliding_window")
    if not window:
        raise UnsupportedModelError("config.json: sliding layers without a sliding_window size")
    return {"layer_types": types, "sliding_window": int(window)}


def _llama(cfg: dict) -> dict:
    bias = bool(cfg.get("attention_bias", False))
    return {"attention_bias": bias, "o_proj_bias": bias, "mlp_bias": bool(cfg.get("mlp_bias", False))}


def _mistral(cfg: dict) -> dict:
    # Mistral's sliding_window, where set, applies to every layer
    return {**_llama(cfg), **_window(cfg, _layer_types(cfg, lambda i: bool(cfg.get("sliding_window"))))}


def _qwen_window(cfg: dict) -> dict:
    """Qwen2/Qwen3: layers from `max_window_layers` on slide, where `use_sliding_window` is set."""
    slides = bool(cfg.get("use_sliding_window")) and cfg.get("sliding_window") is not None
    first = cfg.get("max_window_layers", cfg["num_hidden_layers"])
    if not slides:
        return {}
    return _window(cfg, _layer_types(cfg, lambda i: i >= first))


def _qwen2(cfg: dict) -> dict:
    return {"attention_bias": True, **_qwen_window(cfg)}


def _qwen3(cfg: dict) -> dict:
    return {**_llama(cfg), "mlp_bias": False, "qk_norm": True, **_qwen_window(cfg)}


def _gemma(cfg: dict, every: int) -> dict:
    """Gemma 2 (`every` 2: every other layer slides) and Gemma 3 text (`every` 6, or `sliding_window_pattern`)."""
    every = cfg.get("sliding_window_pattern", every)
    out = {
        "family": "gemma",
        "hidden_act": cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh",
        "attention_bias": bool(cfg.get("attention_bias", False)),
        "o_proj_bias": bool(cfg.get("attention_bias", False)),
        "attn_softcap": float(cfg.get("attn_logit_softcapping") or 0.0),
        "final_softcap": float(cfg.get("final_logit_softcapping") or 0.0),
        "query_scale": float(cfg.get("query_pre_attn_scalar") or cfg.get("head_dim") or 256) ** -0.5,
        "embed_scale": math.sqrt(cfg["hidden_size"]),
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", True)),
    }
    if cfg.get("use_bidirectional_attention"):
        raise UnsupportedModelError(
            "config.json: use_bidirectional_attention is not supported (a decoder attends causally)"
        )
    return {**out, **_window(cfg, _layer_types(cfg, lambda i: bool((i + 1) % every)))}


def _gemma3(cfg: dict) -> dict:
    out = {**_gemma(cfg, 6), "qk_norm": True}
    params, most = cfg.get("rope_parameters") or {}, cfg.get("max_position_embeddings", 131072)
    if "sliding_attention" in params or "full_attention" in params:  # transformers 5: one RoPE per layer type
        full_p, local_p = params.get("full_attention") or {}, params.get("sliding_attention") or {}
        full = {"rope_parameters": full_p, "rope_theta": full_p.get("rope_theta", 1_000_000.0)}
        local = {"rope_parameters": local_p, "rope_theta": local_p.get("rope_theta", 10000.0)}
    else:  # transformers 4: rope_theta and rope_scaling global, rope_local_base_freq the sliding layers'
        full = {"rope_scaling": cfg.get("rope_scaling"), "rope_theta": cfg.get("rope_theta", 1_000_000.0)}
        local = {"rope_theta": cfg.get("rope_local_base_freq", 10000.0)}
    full["max_position_embeddings"] = local["max_position_embeddings"] = most
    try:
        theta, scaling = RopeScaling.from_config(full)
        local_theta, local_scaling = RopeScaling.from_config(local)
    except RopeConfigError as e:
        raise UnsupportedModelError(str(e)) from None
    return {**out, "rope_theta": theta, "rope_scaling": scaling, "local_rope": (local_theta, local_scaling)}


def _moe_layers(cfg: dict) -> tuple[int, ...]:
    """Qwen-MoE: every `decoder_sparse_step`-th layer, less `mlp_only_layers`; Mixtral: every layer."""
    step = cfg.get("decoder_sparse_step", 1) or 1
    dense = set(cfg.get("mlp_only_layers") or [])
    return tuple(i for i in range(cfg["num_hidden_layers"]) if i not in dense and (i + 1) % step == 0)


def _mixtral(cfg: dict) -> dict:
    moe = MoEConfig(
        int(cfg["num_local_experts"]),
        int(cfg["num_experts_per_tok"]),
        cfg["intermediate_size"],
        True,
        tuple(range(cfg["num_hidden_layers"])),
        ("block_sparse_moe", "w1", "w3", "w2"),
    )
    return {**_mistral(cfg), "moe": moe}


def _qwen3_moe(cfg: dict) -> dict:
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    moe = MoEConfig(
        int(experts),
        int(cfg["num_experts_per_tok"]),
        cfg["moe_intermediate_size"],
        bool(cfg.get("norm_topk_prob", False)),
        _moe_layers(cfg),
    )
    return {**_qwen3(cfg), "moe": moe}


def _phi3(cfg: dict) -> dict:
    return {**_llama(cfg), "fused_projections": True, **_window(cfg, _layer_types(cfg, lambda i: False))}


_SLIDING = frozenset({"sliding_window", "use_sliding_window", "layer_types", "max_window_layers"})
_GEMMA = _SLIDING | {"attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar"}
_EXPERTS = frozenset({"num_local_experts", "num_experts", "num_experts_per_tok"})

FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": Family(_llama),
    "MistralForCausalLM": Family(_mistral, _SLIDING),
    "Qwen2ForCausalLM": Family(_qwen2, _SLIDING),
    "Qwen3ForCausalLM": Family(_qwen3, _SLIDING),
    "Gemma2ForCausalLM": Family(lambda cfg: _gemma(cfg, 2), _GEMMA),
    "Gemma3ForCausalLM": Family(_gemma3, _GEMMA),
    "Phi3ForCausalLM": Family(_phi3, _SLIDING | {"partial_rotary_factor"}),
    "MixtralForCausalLM": Family(_mixtral, _SLIDING | _EXPERTS),
    "Qwen3MoeForCausalLM": Family(_qwen3_moe, _SLIDING | _EXPERTS),
}
SUPPORTED_ARCHITECTURES = tuple(FAMILIES)
