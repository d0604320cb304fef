"""Refuse, before any stage starts, a checkpoint ringsched would load silently wrong: its config.json first
(`weights/config_check.py`), then its tensors: ones the model would leave unread (FP8 scales, GPTQ/AWQ packs, layers
of another kind) or ones it needs and lacks. Each message names the field or the tensors and what to do."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ringsched.layout.rank import StageInfo
from ringsched.models.llama import StageModel
from ringsched.weights.checkpoint_names import checkpoint_names, weight_index
from ringsched.weights.config_check import check_config
from ringsched.weights.model_config import ModelConfig, UnsupportedModelError
from ringsched.weights.model_files import check_shapes, tensor_shapes, weight_files

# Tensors some checkpoints carry that the model has no use for and that change nothing.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_QUANT_HINTS = {
    "weight_scale": "FP8 (its weight_scale tensors)",
    "input_scale": "FP8 (its input_scale tensors)",
    "qweight": "GPTQ/AWQ (its qweight tensors)",
    "qzeros": "GPTQ/AWQ (its qzeros tensors)",
    "g_idx": "GPTQ (its g_idx tensors)",
    "scales": "a quantized format (its scales tensors)",
}


def expected_shapes(cfg: ModelConfig) -> dict[str, torch.Size]:
    """The name and shape of every tensor a whole (one-stage) model of `cfg` reads."""
    with torch.device("meta"):
        model = StageModel(cfg, StageInfo(0, 1, 0, cfg.num_layers))
    return {name: t.shape for name, t in model.state_dict().items()}


def check_tensors(cfg: ModelConfig, names: set[str], shapes: dict[str, torch.Size] | None = None) -> None:
    """Raise `UnsupportedModelError` if the checkpoint's tensor `names` miss one the model needs or hold ones it would
    not read (those it holds fused, Phi-3's `qkv_proj` and `gate_up_proj`, by their fused names). `shapes`:
    `expected_shapes(cfg)`, where the caller has them."""
    want = checkpoint_names(cfg, shapes if shapes is not None else expected_shapes(cfg))
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
    """The checks for the model in `model_dir`: its config.json, its safetensors files whole and of the shapes the
    config implies (`weights/model_files.py`), then the names of their tensors."""
    model_dir = Path(model_dir)
    check_config(json.loads((model_dir / "config.json").read_text()))
    found = {path: tensor_shapes(path) for path in weight_files(model_dir)}  # each file whole, or one line
    shapes = expected_shapes(cfg)
    check_tensors(cfg, set(weight_index(model_dir)), shapes)
    check_shapes(found, {k: list(v) for k, v in shapes.items()}, model_dir / "config.json")
