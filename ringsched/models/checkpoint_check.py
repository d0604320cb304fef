"""Refuse, before any stage starts, a checkpoint ringsched would load silently wrong: one quantized by a method it
does not implement (`quantization_config`), one whose config asks for computation the model code does not do (a
field of `UNSUPPORTED_FIELDS`), one with tensors the model would leave unread (FP8 scales, GPTQ/AWQ packs, layers
of another kind) or without tensors it needs. Each message names the field or the tensors and what to do."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from ringsched.layout.rank import StageInfo
from ringsched.models.checkpoint_names import checkpoint_names
from ringsched.models.config import ModelConfig, UnsupportedModelError
from ringsched.models.families import FAMILIES

# A config field that changes what the model computes, the values ringsched does not run, and why. Fields the model
# code reads (heads, sizes, biases, RoPE scaling, hidden_act, ...) are checked where they are read, and a family
# that honours one of these (`families.Family.reads`: Gemma's soft-capping, Mistral's window) reads it itself.
UNSUPPORTED_FIELDS: dict[str, tuple[Callable[[object], bool], str]] = {
    "use_sliding_window": (bool, "sliding-window attention is not supported; set it to false to run full attention "
                           "(exact while prompt + output stay within the window)"),
    "layer_types": (lambda v: any(t != "full_attention" for t in v or []),
                    "layers other than full attention (sliding windows) are not supported"),
    "attn_logit_softcapping": (lambda v: v is not None, "attention logit soft-capping is not supported"),
    "final_logit_softcapping": (lambda v: v is not None, "final logit soft-capping is not supported"),
    "partial_rotary_factor": (lambda v: v not in (None, 1, 1.0), "rotary embedding on part of each head is not "
                              "supported"),
    "num_local_experts": (lambda v: bool(v), "mixtures of experts are not supported"),
    "num_experts": (lambda v: bool(v), "mixtures of experts are not supported"),
}  # fmt: skip
# Tensors some checkpoints carry that the model has no use for and that change nothing.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_QUANT_HINTS = {
    "weight_scale": "FP8 (its weight_scale tensors)", "input_scale": "FP8 (its input_scale tensors)",
    "qweight": "GPTQ/AWQ (its qweight tensors)", "qzeros": "GPTQ/AWQ (its qzeros tensors)",
    "g_idx": "GPTQ (its g_idx tensors)", "scales": "a quantized format (its scales tensors)",
}  # fmt: skip


def check_config(raw: dict) -> None:
    """Raise `UnsupportedModelError` naming the first field of config.json ringsched would not honour."""
    quant = raw.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else "?"
        raise UnsupportedModelError(
            f"config.json: quantization_config (quant_method {method!r}) is not supported: ringsched loads float32, "
            "bfloat16 or float16 weights (--quantization int8 quantizes them at load); use the unquantized checkpoint"
        )
    arch = (raw.get("architectures") or ["?"])[0]
    honoured = FAMILIES[arch].reads if arch in FAMILIES else frozenset()
    for field, (unsupported, why) in UNSUPPORTED_FIELDS.items():
        if field not in honoured and field in raw and unsupported(raw[field]):
            raise UnsupportedModelError(f"config.json: {field} = {json.dumps(raw[field])}: {why}")


def expected_shapes(cfg: ModelConfig) -> dict[str, torch.Size]:
    """The name and shape of every tensor a whole (one-stage) model of `cfg` reads."""
    from ringsched.models.llama import StageModel  # the model imports the layers, which import the config

    with torch.device("meta"):
        model = StageModel(cfg, StageInfo(0, 1, 0, cfg.num_layers))
    return {name: t.shape for name, t in model.state_dict().items()}


def check_tensors(cfg: ModelConfig, names: set[str]) -> None:
    """Raise `UnsupportedModelError` if the checkpoint's tensor `names` miss one the model needs or hold ones it would
    not read (those it holds fused, Phi-3's `qkv_proj` and `gate_up_proj`, by their fused names)."""
    want = checkpoint_names(cfg, expected_shapes(cfg))
    optional = {"lm_head.weight"}  # tied, or absent: the embedding serves as the head (`loader`)
    missing = sorted(want - names - optional)
    extra = sorted(n for n in names - want if not n.endswith(IGNORED_SUFFIXES))
    if extra:
        kind = next((hint for n in extra for suffix, hint in _QUANT_HINTS.items() if n.endswith(suffix)), None)
        what = f"; it looks quantized with {kind}, which is not supported" if kind else ""
        raise UnsupportedModelError(
            f"the checkpoint holds {len(extra)} tensor(s) the {cfg.architecture} model would not read, e.g. "
            f"{', '.join(extra[:3])}{what}: loading it would run without them"
        )
    if missing:
        raise UnsupportedModelError(
            f"the checkpoint lacks {len(missing)} tensor(s) the {cfg.architecture} model needs, e.g. "
            f"{', '.join(missing[:3])}"
        )


def check_checkpoint(model_dir: str | Path, cfg: ModelConfig) -> None:
    """Both checks for the model in `model_dir` (its config.json, then the names of its safetensors)."""
    from ringsched.models.loader import weight_index

    check_config(json.loads((Path(model_dir) / "config.json").read_text()))
    check_tensors(cfg, set(weight_index(Path(model_dir))))
