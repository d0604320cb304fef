"""Stage-local, rank-local loading: a rank reads only the tensors its stage owns, and of each only its tensor-
parallel slice, from the safetensors files.

The model is built on the meta device (no memory), then each owned parameter is read lazily by name (sliced on
read under tensor parallelism: the part its layer type holds, `parallel_linear.read_slices`) and assigned. With
tied embeddings the last stage reads `model.embed_tokens.weight` as its `lm_head.weight` even though it does not
own the embedding.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from ringsched.layout.rank import StageInfo
from ringsched.models.config import ModelConfig
from ringsched.models.fused_linear import cpu_layout
from ringsched.models.llama import StageModel
from ringsched.models.parallel_linear import read_slices
from ringsched.models.tp import TPGroup

logger = logging.getLogger(__name__)


@dataclass
class LoadStats:
    tensors_read: list[str] = field(default_factory=list)
    bytes_read: int = 0


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


def load_stage_model(
    model_dir: str | Path,
    stage: StageInfo,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    stats: LoadStats | None = None,
    tp: TPGroup | None = None,
    quantization: str = "none",
) -> StageModel:
    """The stage's part of the model in `model_dir`, its linear layers prepared (`StageModel.prepare_linears`:
    fused projections, `quantization` "int8" or "none")."""
    model_dir = Path(model_dir)
    cfg = ModelConfig.from_dir(model_dir)
    with torch.device("meta"):
        model = StageModel(cfg, stage, tp)
    index = weight_index(model_dir)
    slices = read_slices(model)
    wanted = list(model.state_dict().keys())
    by_file: dict[Path, list[tuple[str, str]]] = {}
    for name in wanted:
        source = name
        if name == "lm_head.weight" and (cfg.tie_word_embeddings or name not in index):
            source = "model.embed_tokens.weight"
        if source not in index:
            raise KeyError(f"{model_dir}: tensor {source!r} is missing from the weights")
        by_file.setdefault(index[source], []).append((name, source))
    state: dict[str, torch.Tensor] = {}
    buffers = _fused_buffers(model, device, dtype)
    for path, names in by_file.items():
        for name, source in names:
            # One handle per tensor: a handle's mapping keeps every page it read resident until it closes, so
            # copying tensors (the CPU layout) through one handle held the file twice at the peak (measured
            # for SmolLM2: 1039 MiB peak against 638 this way).
            with safe_open(path, framework="pt", device="cpu") as f:
                t = _read(f, source, slices.get(name))
            if stats is not None:
                stats.tensors_read.append(source)
                stats.bytes_read += t.numel() * t.element_size()
            if name in buffers:  # its rows of the layer's fused q/k/v or gate/up weight: no second copy later
                state[name] = buffers[name]
                state[name].copy_(t)
            else:
                state[name] = cpu_layout(name, t.to(device=device, dtype=dtype))
    # Tied and both on this stage (pp_size 1): one tensor, not two copies.
    if cfg.tie_word_embeddings and stage.is_first and stage.is_last:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, assign=True, strict=True)
    if cfg.tie_word_embeddings and stage.is_first and stage.is_last:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval().requires_grad_(False).prepare_linears(quantization)


def _fused_buffers(model: StageModel, device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """For each parameter that `StageModel.prepare_linears` fuses, its rows of one buffer per group (laid out as
    `cpu_layout` lays out a projection), so the fused weight is the loaded tensors themselves."""
    out: dict[str, torch.Tensor] = {}
    for group in model.fusion_groups():
        for kind in ("weight", "bias"):
            parts = [(f"{name}.{kind}", mod) for name, mod in group if getattr(mod, kind) is not None]
            if not parts:
                continue
            rows = sum(mod.out_features for _, mod in parts)
            if kind == "bias":
                buf = torch.empty(rows, device=device, dtype=dtype)
            else:
                buf = cpu_layout(parts[0][0], torch.empty(rows, parts[0][1].in_features, device=device, dtype=dtype))
            start = 0
            for name, mod in parts:
                out[name] = buf[start : start + mod.out_features]
                start += mod.out_features
    return out


def _read(f, name: str, part: tuple[int, int, int] | None) -> torch.Tensor:
    """Tensor `name`, or only rows (dim 0) or columns (dim 1) `[start, stop)` of it: a slice read from the file
    (a 1-D bias takes dim 0's)."""
    if part is None:
        return f.get_tensor(name)
    dim, start, stop = part
    view = f.get_slice(name)
    t = view[start:stop] if dim == 0 or len(view.get_shape()) == 1 else view[:, start:stop]
    return t.contiguous()


def weights_bytes(model: torch.nn.Module) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total
