"""Where each parameter of the model is in a checkpoint: a tensor of its own name, or rows of a fused tensor.

The model keeps q/k/v and gate/up as separate projections (a stage fuses them itself after loading,
`StageModel.prepare_linears`). A checkpoint with `ModelConfig.fused_projections` (Phi-3, Phi-4) holds them fused:
`self_attn.qkv_proj` `[(H + 2 * KVH) * D, hidden]` (q's rows, then k's, then v's) and `mlp.gate_up_proj`
`[2 * intermediate, hidden]` (gate's rows, then up's); each parameter is then read as its rows of that tensor
(`loader`), and those are the names `checkpoint_check` expects.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from safetensors import safe_open

from ringsched.weights.model_config import ModelConfig


@dataclass(frozen=True)
class Source:
    """The checkpoint tensor `name` a parameter is read from; `row0`: the parameter's first row in it, where it is
    a part of a fused tensor (None: the tensor is the parameter's own)."""

    name: str
    row0: int | None = None


def fused_parts(cfg: ModelConfig) -> dict[str, tuple[str, int]]:
    """Each projection held fused, by its module name within a layer: (the fused module's name, its first row
    there). Empty for a checkpoint that holds the projections apart."""
    if not cfg.fused_projections:
        return {}
    q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    return {
        "self_attn.q_proj": ("self_attn.qkv_proj", 0),
        "self_attn.k_proj": ("self_attn.qkv_proj", q),
        "self_attn.v_proj": ("self_attn.qkv_proj", q + kv),
        "mlp.gate_proj": ("mlp.gate_up_proj", 0),
        "mlp.up_proj": ("mlp.gate_up_proj", inter),
    }


def source(name: str, parts: dict[str, tuple[str, int]]) -> Source:
    """Where parameter `name` (`model.layers.3.self_attn.k_proj.weight`) is in the checkpoint, `parts` being
    `fused_parts` of the model."""
    module, _, kind = name.rpartition(".")
    for part, (fused, row0) in parts.items():
        if module.endswith(f".{part}"):
            return Source(f"{module[: -len(part)]}{fused}.{kind}", row0)
    return Source(name)


def checkpoint_names(cfg: ModelConfig, params: Iterable[str]) -> set[str]:
    """The names of the checkpoint tensors parameters `params` of a model of `cfg` are read from."""
    parts = fused_parts(cfg)
    return {source(name, parts).name for name in params}


def weight_index(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> file, for one `model.safetensors` or a sharded index."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        mapping = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / fname for name, fname in mapping.items()}
    single = model_dir / "model.safetensors"
    if not single.exists():
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {model_dir}")
    with safe_open(single, framework="pt") as f:
        return {name: single for name in f.keys()}
