"""How llama.cpp stores each architecture ringsched runs, read back into Hugging Face's terms: per GGUF
`general.architecture`, the config.json fields (from the `<arch>.*` metadata keys and the tensors present), each
block tensor's Hugging Face name, and what llama.cpp's converter did to the weights that must be undone.

What the converter does, and so what `gguf_import` undoes: for `llama` (Llama, Mistral, Mixtral) it permutes the
rows of Q and K (and their biases) so each head's two rotary halves interleave (`permuted_qk`); the NEOX-rotary
architectures (Qwen2/3, Gemma, Phi-3) it leaves alone. For Gemma it adds 1 to every RMSNorm weight
(`norm_shift`: Hugging Face's checkpoint stores `w` and computes `1 + w`). It stacks a layer's experts into one
`[E, out, in]` tensor per projection (`ffn_gate_exps`, `ffn_up_exps`, `ffn_down_exps`), split here into the
per-expert tensors the family's `MoEConfig.names` says. Phi-3's `attn_qkv` and `ffn_up` stay fused (ringsched
reads Phi-3's fused checkpoints), and its longrope factors, like Llama 3.1's scaled frequencies, travel as tensors
(`CONFIG_TENSORS`) that become config fields.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ringsched.weights.families import UnsupportedModelError
from ringsched.weights.gguf_meta import Meta

# Tensors llama.cpp stores that are config, not weights: per-frequency RoPE divisors.
CONFIG_TENSORS = frozenset({"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"})
TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


@dataclass(frozen=True)
class GGUFFamily:
    """`config(meta)`: config.json's fields beyond the shared ones (`architectures` among them); `layers`: each
    block tensor's name within a Hugging Face layer; `experts`: the (block, gate, up, down) module names stacked
    experts split into; `permuted_qk`, `norm_shift`: what the converter did (see the module's docstring)."""

    config: Callable[[Meta], dict]
    layers: dict[str, str]
    experts: tuple[str, str, str, str] | None = None
    permuted_qk: bool = False
    norm_shift: float = 0.0


def _blocks(meta: Meta) -> int:
    return int(meta.of("block_count"))


def _one(value, key: str) -> int:
    """A count llama.cpp may store per layer (an array) where ringsched needs it the same in every layer."""
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise UnsupportedModelError(f"GGUF {key} differs between layers ({sorted(set(value))}): not supported")
        value = value[0]
    return int(value)


def _rope_scaling(meta: Meta) -> dict | None:
    """rope_scaling from `<arch>.rope.scaling.*`, or from Llama 3.1's `rope_freqs` tensor."""
    if "rope_freqs.weight" in meta.shapes:
        # llama.cpp stores Llama 3.1's scaled RoPE as each frequency's divisor, not as its parameters: longrope with
        # those divisors on both sides of the original length (and factor 1: no attention scaling) is that RoPE
        divisors = meta.values("rope_freqs.weight")
        return {
            "rope_type": "longrope",
            "factor": 1.0,
            "short_factor": divisors,
            "long_factor": divisors,
            "original_max_position_embeddings": int(meta.of("context_length", 4096)),
        }
    kind = meta.of("rope.scaling.type")
    if kind in (None, "none") or "rope_factors_long.weight" in meta.shapes:  # longrope: `_phi3` reads it
        return None
    factor = float(meta.of("rope.scaling.factor", 1.0))
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        out = {"rope_type": "yarn", "factor": factor}
        for key, name in (
            ("original_context_length", "original_max_position_embeddings"),
            ("yarn_beta_fast", "beta_fast"),
            ("yarn_beta_slow", "beta_slow"),
        ):
            if meta.of(f"rope.scaling.{key}") is not None:
                out[name] = meta.of(f"rope.scaling.{key}")
        return out
    raise UnsupportedModelError(f"GGUF {meta.arch}.rope.scaling.type {kind!r} is not supported (linear and yarn are)")


def shared_config(meta: Meta) -> dict:
    """The config.json fields every family has, from the file's metadata; the lm_head is tied when the file has
    none (llama.cpp then leaves `output.weight` out)."""
    heads = int(meta.of("attention.head_count"))
    hidden = int(meta.of("embedding_length"))
    scaling = _rope_scaling(meta)
    return {
        "architectures": [],
        "model_type": "",
        "num_hidden_layers": _blocks(meta),
        "hidden_size": hidden,
        "intermediate_size": int(meta.of("feed_forward_length", 0) or meta.of("expert_feed_forward_length", 0)),
        "num_attention_heads": heads,
        "num_key_value_heads": _one(meta.of("attention.head_count_kv", heads), "attention.head_count_kv"),
        "head_dim": int(meta.of("attention.key_length") or hidden // heads),
        "vocab_size": int(meta.of("vocab_size", meta.shapes["token_embd.weight"][0])),
        "rms_norm_eps": float(meta.of("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(meta.of("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta.of("context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in meta.shapes,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "hidden_act": "silu",
        "attention_bias": "blk.0.attn_q.bias" in meta.shapes,
        "torch_dtype": "float32",
        **({"rope_scaling": scaling} if scaling else {}),
    }


def _llama(meta: Meta) -> dict:
    """Llama; Mistral where the file states a sliding window; Mixtral where it has experts (all are `llama` to
    llama.cpp)."""
    out = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    dims = meta.of("rope.dimension_count")  # the head size, where it is not hidden / heads (Mistral Nemo)
    if not meta.of("attention.key_length") and dims:
        out["head_dim"] = int(dims)
    if "blk.0.ffn_up.bias" in meta.shapes:
        out["mlp_bias"] = True
    window = int(meta.of("attention.sliding_window", 0) or 0)
    if window:
        out.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=window)
    if meta.of("expert_count", 0):  # each expert's width is the file's feed_forward_length
        out.update(
            architectures=["MixtralForCausalLM"],
            model_type="mixtral",
            sliding_window=window or None,
            num_local_experts=int(meta.of("expert_count")),
            num_experts_per_tok=int(meta.of("expert_used_count")),
        )
        if meta.of("expert_feed_forward_length"):
            out["intermediate_size"] = int(meta.of("expert_feed_forward_length"))
    return out


def _named(architecture: str, model_type: str) -> Callable[[Meta], dict]:
    """A family whose config.json needs nothing beyond the shared fields but its name (Qwen2, Qwen3)."""
    return lambda meta: {"architectures": [architecture], "model_type": model_type}


def _qwen3_moe(meta: Meta) -> dict:
    # layers with a dense MLP (`ffn_gate`) among the sparse ones; llama.cpp always renormalises the top-k weights
    dense = [i for i in range(_blocks(meta)) if f"blk.{i}.ffn_gate.weight" in meta.shapes]
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "num_experts": int(meta.of("expert_count")),
        "num_experts_per_tok": int(meta.of("expert_used_count")),
        "moe_intermediate_size": int(meta.of("expert_feed_forward_length")),
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": dense,
    }


def _gemma(meta: Meta, every: int, big_layers: int) -> dict:
    """Gemma 2 (`every` 2: every other layer slides) and Gemma 3 (`every` 6) as llama.cpp runs them: it scales
    queries by `head_dim ** -0.5`, but by `(hidden / heads) ** -0.5` for the 27B model (`big_layers` layers), the
    `query_pre_attn_scalar` of those models' configs."""
    n, hidden, heads = _blocks(meta), int(meta.of("embedding_length")), int(meta.of("attention.head_count"))
    window = int(meta.of("attention.sliding_window", 0) or 0)
    pattern = meta.of("attention.sliding_window_pattern", every)
    slides = [bool(p) for p in pattern] if isinstance(pattern, list) else [bool((i + 1) % pattern) for i in range(n)]
    head_dim = int(meta.of("attention.key_length") or hidden // heads)
    return {
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": hidden // heads if n == big_layers else head_dim,
        "sliding_window": window or None,
        "layer_types": ["sliding_attention" if window and s else "full_attention" for s in slides],
    }


def _gemma2(meta: Meta) -> dict:
    # llama.cpp's defaults where the file states no soft-caps are Gemma 2's own
    return {
        "architectures": ["Gemma2ForCausalLM"],
        "model_type": "gemma2",
        **_gemma(meta, 2, 46),
        "attn_logit_softcapping": float(meta.of("attn_logit_softcapping", 50.0)),
        "final_logit_softcapping": float(meta.of("final_logit_softcapping", 30.0)),
    }


def _gemma3(meta: Meta) -> dict:
    # sliding layers rotate with their own base, 10000 unless the file says (llama.cpp's fixed value)
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        **_gemma(meta, 6, 62),
        "rope_theta": float(meta.of("rope.freq_base", 1_000_000.0)),
        "rope_local_base_freq": float(meta.of("rope.freq_base_swa", 10000.0)),
        "attn_logit_softcapping": None,
        "final_logit_softcapping": meta.of("final_logit_softcapping"),
    }


def _phi3(meta: Meta) -> dict:
    """Phi-3/Phi-4: longrope from the `rope_factors_*` tensors (llama.cpp derives the attention factor by the same
    formula transformers does, so it is not repeated), partial rotary where `rope.dimension_count` is a part of
    the head."""
    out = {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3"}
    heads, hidden = int(meta.of("attention.head_count")), int(meta.of("embedding_length"))
    head_dim, rotary = int(meta.of("attention.key_length") or hidden // heads), meta.of("rope.dimension_count")
    if rotary and int(rotary) < head_dim:
        out["partial_rotary_factor"] = int(rotary) / head_dim
    if meta.of("attention.sliding_window"):
        out["sliding_window"] = int(meta.of("attention.sliding_window"))
    if "rope_factors_long.weight" in meta.shapes:
        original = int(meta.of("rope.scaling.original_context_length"))
        out["original_max_position_embeddings"] = original
        out["rope_scaling"] = {
            "type": "longrope",
            "short_factor": meta.values("rope_factors_short.weight"),
            "long_factor": meta.values("rope_factors_long.weight"),
        }
    return out


_ATTENTION = {
    "attn_norm.weight": "input_layernorm.weight",
    **{f"attn_{p}.{k}": f"self_attn.{p}_proj.{k}" for p in "qkv" for k in ("weight", "bias")},
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
}
_MLP = {f"ffn_{p}.{k}": f"mlp.{p}_proj.{k}" for p in ("gate", "up", "down") for k in ("weight", "bias")}
_QK_NORM = {"attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight"}
_LLAMA = {**_ATTENTION, **_MLP, "ffn_norm.weight": "post_attention_layernorm.weight"}
_GEMMA = {
    **_ATTENTION,
    **_MLP,
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_PHI3 = {**_LLAMA, "attn_qkv.weight": "self_attn.qkv_proj.weight", "ffn_up.weight": "mlp.gate_up_proj.weight"}

GGUF_FAMILIES: dict[str, GGUFFamily] = {
    "llama": GGUFFamily(
        _llama,
        {**_LLAMA, "ffn_gate_inp.weight": "block_sparse_moe.gate.weight"},
        experts=("block_sparse_moe", "w1", "w3", "w2"),
        permuted_qk=True,
    ),
    "qwen2": GGUFFamily(_named("Qwen2ForCausalLM", "qwen2"), _LLAMA),
    "qwen3": GGUFFamily(_named("Qwen3ForCausalLM", "qwen3"), {**_LLAMA, **_QK_NORM}),
    "qwen3moe": GGUFFamily(
        _qwen3_moe,
        {**_LLAMA, **_QK_NORM, "ffn_gate_inp.weight": "mlp.gate.weight"},
        experts=("mlp", "gate_proj", "up_proj", "down_proj"),
    ),
    "gemma2": GGUFFamily(_gemma2, _GEMMA, norm_shift=1.0),
    "gemma3": GGUFFamily(_gemma3, {**_GEMMA, **_QK_NORM}, norm_shift=1.0),
    "phi3": GGUFFamily(_phi3, _PHI3),
}


def family_of(meta: Meta, source: str) -> GGUFFamily:
    """The family of the file `source` names; `UnsupportedModelError` naming its architecture otherwise."""
    if meta.arch not in GGUF_FAMILIES:
        raise UnsupportedModelError(
            f"{source}: GGUF architecture {meta.arch!r} is not supported; ringsched converts {', '.join(GGUF_FAMILIES)}"
        )
    return GGUF_FAMILIES[meta.arch]


def hf_config(meta: Meta, family: GGUFFamily) -> dict:
    return {**shared_config(meta), **family.config(meta)}
