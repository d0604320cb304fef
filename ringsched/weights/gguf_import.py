"""Turn a GGUF file of an architecture ringsched runs into a Hugging Face-layout model directory.

Reads the file's metadata into config.json (`gguf_families`) and its tokenizer into tokenizer files
(`gguf_tokenizer`), then dequantizes every tensor to float32 with the `gguf` package, renames it to its Hugging
Face name and undoes what llama.cpp's converter did to it (see `gguf_families`): Q and K un-permuted for `llama`
(the converter interleaves the two rotary halves of each head; Hugging Face's rotate-half RoPE expects them split:
without the undo the model talks nonsense), 1 taken back off Gemma's norms, stacked experts split per expert.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from ringsched.weights.config_check import check_config
from ringsched.weights.families import UnsupportedModelError
from ringsched.weights.gguf_families import CONFIG_TENSORS, TOP_NAMES, GGUFFamily, family_of, hf_config
from ringsched.weights.gguf_meta import Meta
from ringsched.weights.gguf_tokenizer import stop_ids, write_gguf_tokenizer
from ringsched.weights.model_config import ModelConfig

SHARD_BYTES = 2 << 30  # float32 weights held in memory at once while converting: a larger model is written in shards


def unpermute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute`: rows of each head go from (d/2, 2) interleaved to (2, d/2)."""
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_tensors(family: GGUFFamily, gguf_name: str, arr: np.ndarray, arch: str) -> dict[str, np.ndarray]:
    """The Hugging Face tensors of GGUF tensor `gguf_name` of a file of architecture `arch` (one, or one per expert
    of a stacked tensor), before the undoing of permutes and norm shifts."""
    if gguf_name in TOP_NAMES:
        return {TOP_NAMES[gguf_name]: arr}
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", gguf_name)
    part = m.group(2) if m else ""
    layer = f"model.layers.{m.group(1)}." if m else ""
    if part in family.layers:
        return {layer + family.layers[part]: arr}
    stacked = re.fullmatch(r"ffn_(gate|up|down)_exps\.weight", part)
    if stacked and family.experts:
        block, gate, up, down = family.experts
        proj = {"gate": gate, "up": up, "down": down}[stacked.group(1)]
        return {f"{layer}{block}.experts.{e}.{proj}.weight": arr[e] for e in range(arr.shape[0])}
    raise UnsupportedModelError(
        f"unexpected tensor {gguf_name!r} in a GGUF file of architecture {arch!r}: "
        "ringsched does not know where it goes"
    )


def convert_gguf(gguf_path: Path, out_dir: Path, quiet: bool = False) -> Path:
    """One pass from a GGUF file to a Hugging Face-layout directory: config.json and generation_config.json,
    tokenizer files, tensors in float32. Refuses (`UnsupportedModelError`) an architecture, tokenizer or config
    ringsched does not run before it dequantizes anything."""
    import gguf  # imported here: only the converter needs it

    meta = Meta(gguf.GGUFReader(str(gguf_path)))
    family = family_of(meta, gguf_path.name)
    if int(meta.get("split.count", 1)) > 1:
        raise UnsupportedModelError(
            f"{gguf_path.name} is one part of a split GGUF file ({meta.get('split.count')} "
            "parts); merge them with llama.cpp's `llama-gguf-split --merge` first"
        )
    config = hf_config(meta, family)
    check_config(config)
    ModelConfig.from_dict(config)  # refuses what the model code does not run, naming it
    out_dir.mkdir(parents=True, exist_ok=True)
    write_gguf_tokenizer(meta, out_dir, config["max_position_embeddings"])
    _write_weights(meta, family, config, out_dir, quiet)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    stops = stop_ids(meta)
    eos = stops if len(stops) > 1 else config["eos_token_id"]
    gen = {"bos_token_id": config["bos_token_id"], "eos_token_id": eos, "do_sample": False}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2))
    return out_dir


def _write_weights(meta: Meta, family: GGUFFamily, config: dict, out_dir: Path, quiet: bool) -> None:
    """The weights as safetensors, a shard of up to `SHARD_BYTES` at a time (so the float32 model is never whole in
    memory): one `model.safetensors` where it fits in one, else `model-NNNNN.safetensors` and their index."""
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    held = total = 0
    for name, tensor in _weights(meta, family, config, quiet):
        shard[name] = tensor
        held += tensor.nbytes
        if held >= SHARD_BYTES:
            _save_shard(shard, out_dir, weight_map)
            shard, total, held = {}, total + held, 0
    if not weight_map:
        save_file(shard, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        return
    if shard:
        _save_shard(shard, out_dir, weight_map)
    index = {"metadata": {"total_size": total + held}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _save_shard(shard: dict[str, torch.Tensor], out_dir: Path, weight_map: dict[str, str]) -> None:
    file = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
    save_file(shard, str(out_dir / file), metadata={"format": "pt"})
    weight_map.update(dict.fromkeys(shard, file))


def _weights(meta: Meta, family: GGUFFamily, config: dict, quiet: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """Every weight in float32 under its Hugging Face name, as the Hugging Face checkpoint holds it."""
    import gguf

    total = len(meta.reader.tensors)
    for i, t in enumerate(meta.reader.tensors, 1):
        if t.name not in CONFIG_TENSORS:
            arr = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
            for name, w in hf_tensors(family, t.name, arr, meta.arch).items():
                yield name, torch.from_numpy(np.ascontiguousarray(_undone(family, config, name, w)))
        if not quiet and (i % 16 == 0 or i == total):
            print(f"\rdequantizing tensors {i}/{total}", end="", file=sys.stderr, flush=True)
    if not quiet:
        print(file=sys.stderr)


def _undone(family: GGUFFamily, config: dict, name: str, w: np.ndarray) -> np.ndarray:
    """Tensor `name` with what llama.cpp's converter did to it undone."""
    if family.permuted_qk and re.search(r"\.(q|k)_proj\.(weight|bias)$", name):
        heads = config["num_attention_heads"] if ".q_proj." in name else config["num_key_value_heads"]
        return unpermute_rotary(w, heads)
    if family.norm_shift and name.endswith("norm.weight"):
        return w - np.float32(family.norm_shift)
    return w
