"""Refuse, before any stage starts, a config.json that asks for computation the model code does not do: quantized
by a method ringsched does not implement (`quantization_config`), or a field of `UNSUPPORTED_FIELDS`. The tensors
are checked against the model in `models/checkpoint_check.py`."""

from __future__ import annotations

import json
from collections.abc import Callable

from ringsched.weights.families import FAMILIES
from ringsched.weights.model_config import UnsupportedModelError

# A config field that changes what the model computes, the values ringsched does not run, and why. Fields the model
# code reads (heads, sizes, biases, RoPE scaling, hidden_act, ...) are checked where they are read, and a family
# that honours one of these (`families.Family.reads`: Gemma's soft-capping, Mistral's window) reads it itself.
UNSUPPORTED_FIELDS: dict[str, tuple[Callable[[object], bool], str]] = {
    "use_sliding_window": (
        bool,
        "sliding-window attention is not supported; set it to false to run full attention "
        "(exact while prompt + output stay within the window)",
    ),
    "layer_types": (
        lambda v: any(t != "full_attention" for t in v or []),
        "layers other than full attention (sliding windows) are not supported",
    ),
    "attn_logit_softcapping": (lambda v: v is not None, "attention logit soft-capping is not supported"),
    "final_logit_softcapping": (lambda v: v is not None, "final logit soft-capping is not supported"),
    "partial_rotary_factor": (
        lambda v: v not in (None, 1, 1.0),
        "rotary embedding on part of each head is not supported",
    ),
    "num_local_experts": (lambda v: bool(v), "mixtures of experts are not supported"),
    "num_experts": (lambda v: bool(v), "mixtures of experts are not supported"),
}


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
