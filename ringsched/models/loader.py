"""Stage-local, rank-local loading: a rank reads only the tensors its stage owns, and of each only its tensor-
parallel slice, from the safetensors files.

The model is built on the meta device (no memory), then each owned parameter is read lazily by name (sliced on
read under tensor parallelism: the part its layer type holds, `parallel_linear.read_slices`) and assigned. With
tied embeddings the last stage reads `model.embed_tokens.weight` as its `lm_head.weight` even though it does not
own the embedding. A projection the checkpoint holds fused (Phi-3's `qkv_proj`, `gate_up_proj`) is read as its
rows of the fused tensor (`checkpoint_names`), under tensor parallelism only the rank's rows of those.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from ringsched.layout.rank import StageInfo
from ringsched.models.fused_linear import cpu_layout
from ringsched.models.llama import StageModel
from ringsched.models.parallel_linear import read_slices
from ringsched.models.tp import TPGroup
from ringsched.models.vocab import Embedding
from ringsched.weights.checkpoint_names import Source, fused_parts, source, weight_index
from ringsched.weights.gguf_kept import keep
from ringsched.weights.gguf_weights import GGUFCheckpoint, gguf_file
from ringsched.weights.model_config import ModelConfig

logger = logging.getLogger(__name__)


@dataclass
class LoadStats:
    tensors_read: list[str] = field(default_factory=list)
    bytes_read: int = 0


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
    slices, shapes = read_slices(model), {name: t.shape for name, t in model.state_dict().items()}
    state: dict[str, torch.Tensor] = {}
    kept = _kept_checkpoint(model_dir) if quantization == "gguf" else None
    buffers = {} if kept else _fused_buffers(model, device, dtype)
    index = {name: kept.path for name in kept.names()} if kept else weight_index(model_dir)
    for path, names in _sources(index, model_dir, cfg, list(shapes)).items():
        for name, src in names:
            qtype = 0
            if kept:
                t, qtype = kept.read(src, slices.get(name), shapes[name][0])
            else:
                # One handle per tensor: a handle's mapping keeps every page it read resident until it closes, so
                # copying tensors (the CPU layout) through one handle held the file twice at the peak (measured
                # for SmolLM2: 1039 MiB peak against 638 this way).
                with safe_open(path, framework="pt", device="cpu") as f:
                    t = _read(f, src, slices.get(name), shapes[name][0])
            if stats is not None:
                stats.tensors_read.append(src.name)
                stats.bytes_read += t.numel() * t.element_size()
            if qtype:  # a GGUF tensor kept as its blocks: its module holds them as they are
                state[name] = _keep(model, name, t, qtype, dtype)
            elif name in buffers:  # its rows of the layer's fused q/k/v or gate/up weight: no second copy later
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


def _kept_checkpoint(model_dir: Path) -> GGUFCheckpoint:
    path = gguf_file(model_dir)
    if path is None:
        raise ValueError(
            f"--quantization gguf: {model_dir} was not made from a GGUF file; give --model FILE.gguf "
            "(or the default model), or another --quantization"
        )
    return GGUFCheckpoint(path, model_dir)


def _keep(model: StageModel, name: str, raw: torch.Tensor, qtype: int, dtype: torch.dtype) -> torch.Tensor:
    """Parameter `name`'s module holding GGUF blocks `raw` of type `qtype` as its weight (which it returns)."""
    module = model.get_submodule(name.rsplit(".", 1)[0])
    if isinstance(module, Embedding):
        module.keep_gguf(raw, qtype, dtype)
    else:
        keep(module, raw, qtype)
    return module.weight


def _sources(
    index: dict[str, Path], model_dir: Path, cfg: ModelConfig, wanted: list[str]
) -> dict[Path, list[tuple[str, Source]]]:
    """Each parameter of `wanted` with where the checkpoint (`index`: tensor name -> file) holds it, by file."""
    parts = fused_parts(cfg)
    by_file: dict[Path, list[tuple[str, Source]]] = {}
    for name in wanted:
        src = source(name, parts)
        if name == "lm_head.weight" and (cfg.tie_word_embeddings or name not in index):
            src = Source("model.embed_tokens.weight")
        if src.name not in index:
            raise KeyError(f"{model_dir}: tensor {src.name!r} is missing from the weights")
        by_file.setdefault(index[src.name], []).append((name, src))
    return by_file


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


def _read(f, src: Source, part: tuple[int, int, int] | None, rows: int) -> torch.Tensor:
    """The parameter's tensor: `src.name`, or only rows (dim 0) or columns (dim 1) `[start, stop)` of it, a slice
    read from the file (a 1-D bias takes dim 0's). A part of a fused tensor (`src.row0`) is its `rows` rows from
    `row0`, the slice's rows counted from there."""
    if part is None and src.row0 is None:
        return f.get_tensor(src.name)
    dim, start, stop = part if part is not None else (0, 0, rows)
    row0 = src.row0 or 0
    view = f.get_slice(src.name)
    if dim == 0 or len(view.get_shape()) == 1:
        t = view[row0 + start : row0 + stop]
    else:
        t = view[row0 : row0 + rows, start:stop]
    return t.contiguous()


def weights_bytes(model: torch.nn.Module) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total
