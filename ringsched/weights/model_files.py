"""A model directory's files, checked as readable and whole before any stage starts, each fault one line that
names the file and what is wrong: config.json that does not parse or gives a size out of range, a missing
tokenizer, a safetensors file that is cut short, unreadable, or whose tensors have other shapes than config.json
implies (`vocab_size` 10^9 against a 49152-row embedding). What the model cannot run at all is
`checkpoint_check`'s (unsupported fields, tensors of another kind)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

# config.json's sizes, each a whole number in [1, bound]: past a bound, a size is a typo, not a model
SIZE_FIELDS = {
    "hidden_size": 1 << 17,
    "num_hidden_layers": 1 << 12,
    "num_attention_heads": 1 << 12,
    "intermediate_size": 1 << 20,
    "vocab_size": 1 << 24,
}
OPTIONAL_SIZE_FIELDS = {"num_key_value_heads": 1 << 12, "head_dim": 1 << 12, "max_position_embeddings": 1 << 26}
HEADER_LIMIT = 100 << 20  # safetensors' own bound on a header


class BadModelError(ValueError):
    """A model file that is missing, cut short or inconsistent: one line naming the file and the fault."""


def read_config(model_dir: Path) -> dict:
    """config.json, parsed, with its sizes in range."""
    path = model_dir / "config.json"
    if not path.is_file():
        raise BadModelError(f"{path} does not exist; --model needs a model directory with config.json")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise BadModelError(f"{path}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    if not isinstance(raw, dict):
        raise BadModelError(f"{path}: a JSON object was expected, not {type(raw).__name__}")
    for field, bound in (SIZE_FIELDS | OPTIONAL_SIZE_FIELDS).items():
        if field not in raw and field in OPTIONAL_SIZE_FIELDS or field in raw and raw[field] is None:
            continue
        if field not in raw:
            raise BadModelError(f"{path}: {field} is missing; a decoder's config gives it")
        value = raw[field]
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= bound:
            raise BadModelError(f"{path}: {field} = {json.dumps(value)} is out of range (a whole number, 1 to {bound})")
    return raw


def check_tokenizer(model_dir: Path) -> None:
    if not (model_dir / "tokenizer.json").is_file():
        raise BadModelError(
            f"{model_dir} has no tokenizer.json (the tokenizer the server and the engine read): copy the model's "
            "tokenizer files (tokenizer.json, tokenizer_config.json) into it"
        )


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files the checkpoint is in (one, or those its index names), each present."""
    index = model_dir / "model.safetensors.index.json"
    if not index.exists():
        single = model_dir / "model.safetensors"
        if not single.exists():
            raise BadModelError(f"{model_dir} has no model.safetensors (nor model.safetensors.index.json)")
        return [single]
    try:
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
        raise BadModelError(f"{index}: not a safetensors index (a JSON object with a weight_map)") from None
    missing = [n for n in names if not (model_dir / n).is_file()]
    if missing:
        raise BadModelError(f"{model_dir / missing[0]}, named in {index.name}, does not exist")
    return [model_dir / n for n in names]


def tensor_shapes(path: Path) -> dict[str, list[int]]:
    """The tensors' shapes a safetensors file's header gives, after checking the file holds every byte the header
    places (a download or copy cut short fails here, not in a stage)."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if not 2 <= n <= min(HEADER_LIMIT, size - 8):
                raise ValueError(f"a header of {n} bytes")
            header = json.loads(f.read(n))
        tensors = {k: v for k, v in header.items() if k != "__metadata__"}
        end = max((int(v["data_offsets"][1]) for v in tensors.values()), default=0)
        shapes = {k: [int(d) for d in v["shape"]] for k, v in tensors.items()}
    except (struct.error, ValueError, KeyError, TypeError, AttributeError, IndexError) as e:
        raise BadModelError(f"{path}: not a readable safetensors file ({e})") from None
    if 8 + n + end > size:
        raise BadModelError(f"{path} is cut short: {size} bytes, its header places {8 + n + end} (copy it again)")
    return shapes


def check_shapes(found: dict[Path, dict[str, list[int]]], expected: dict[str, list[int]], config: Path) -> None:
    """Every tensor the model reads under its own name (`found`: each file's `tensor_shapes`) has the shape
    config.json implies."""
    for path, shapes in found.items():
        for name, shape in shapes.items():
            want = expected.get(name)
            if want is not None and list(want) != shape:
                raise BadModelError(
                    f"{path}: {name} is {shape}, but {config} implies {list(want)}: the config does not describe "
                    "these weights"
                )
