"""A stage's weights read from the GGUF file itself, its quantized tensors kept as they are (`--quantization gguf`).

The model directory is the one `gguf_import` made from the file (config, tokenizer, and its marker naming the file);
the weights come from the file, memory-mapped, so a stage touches only its own tensors' pages. Each tensor is found
under its Hugging Face name (`gguf_import.hf_tensors`: stacked experts split per expert as views), with what
llama.cpp's converter did undone (`gguf_import._undone`: Q and K rows un-permuted, which moves whole rows of blocks;
Gemma's norms, float32 in the file, shifted back), then sliced: rows freely (a block runs along a row), columns in
whole blocks (`gguf_linear.column_bytes` refuses a tensor-parallel split that would cut one). A tensor of a type
`gguf_linear` runs stays its blocks; float16/bfloat16/float32 tensors, and the quantizations it does not run, are
read as float.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import torch

from ringsched.models.checkpoint_names import Source
from ringsched.models.gguf_linear import TYPES, column_bytes

logger = logging.getLogger(__name__)

MARKER = "ringsched_source.json"  # written by `fetch` beside a converted model: names the GGUF file
FLOAT_TYPES = {0: np.float32, 1: np.float16}


def gguf_file(model_dir: Path) -> Path | None:
    """The GGUF file `model_dir` was converted from, or None (a Hugging Face checkpoint)."""
    marker = Path(model_dir) / MARKER
    if not marker.exists():
        return None
    path = json.loads(marker.read_text()).get("gguf")
    return Path(path) if path and Path(path).exists() else None


class GGUFCheckpoint:
    """The tensors of a GGUF file under their Hugging Face names, read a parameter (or its slice) at a time."""

    def __init__(self, path: Path, model_dir: Path) -> None:
        import gguf

        from ringsched.models.gguf_families import CONFIG_TENSORS, Meta, family_of
        from ringsched.models.gguf_import import hf_tensors

        self.path = path
        self.reader = gguf.GGUFReader(str(path))
        meta = Meta(self.reader)
        self.family = family_of(meta, path.name)
        self.config = json.loads((Path(model_dir) / "config.json").read_text())
        self.tensors: dict[str, tuple[np.ndarray, int]] = {}
        for t in self.reader.tensors:
            if t.name not in CONFIG_TENSORS:
                for name, arr in hf_tensors(self.family, t.name, t.data, meta.arch).items():
                    self.tensors[name] = (arr, int(t.tensor_type))
        self.unrun = sorted({gguf.GGMLQuantizationType(q).name for _, q in self.tensors.values()
                             if q not in TYPES and q not in FLOAT_TYPES})  # fmt: skip
        if self.unrun:
            logger.warning("%s: %s tensors are dequantized to float at load (the kernels run %s)", path.name,
                           ", ".join(self.unrun), ", ".join(v[0] for v in TYPES.values()))  # fmt: skip

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def names(self) -> list[str]:
        return list(self.tensors)

    def read(self, src: Source, part: tuple[int, int, int] | None, rows: int) -> tuple[torch.Tensor, int]:
        """(tensor, GGUF type): the parameter's blocks `[rows, row_bytes]` uint8 and its type where `gguf_linear`
        runs the type, else float32 values (type 0). `part`, `rows` and `src.row0` as `loader._read` takes them."""
        from ringsched.models.gguf_import import _undone

        arr, qtype = self.tensors[src.name]
        arr = _undone(self.family, self.config, src.name, arr)
        dim, start, stop = part if part is not None else (0, 0, rows)
        row0 = src.row0 or 0
        if part is not None or src.row0 is not None:
            arr = arr[row0 + start : row0 + stop] if dim == 0 or arr.ndim == 1 else arr[row0 : row0 + rows]
        cut = part is not None and dim == 1 and arr.ndim == 2  # columns: a row-parallel rank's inputs
        if qtype in TYPES:
            if cut:
                k = arr.shape[1] // TYPES[qtype][2] * TYPES[qtype][1]
                b0, b1 = column_bytes(qtype, start, stop, k, src.name)
                arr = arr[:, b0:b1]
            return torch.from_numpy(np.array(arr, copy=True, order="C")), qtype  # in the stage's own memory
        values = self._float(arr, qtype)
        return torch.from_numpy(np.array(values[:, start:stop] if cut else values, copy=True, order="C")), 0

    @staticmethod
    def _float(arr: np.ndarray, qtype: int) -> np.ndarray:
        if qtype in FLOAT_TYPES:
            return np.ascontiguousarray(arr, dtype=np.float32)
        import gguf

        return np.ascontiguousarray(gguf.quants.dequantize(np.asarray(arr), gguf.GGMLQuantizationType(qtype)),
                                    dtype=np.float32)  # fmt: skip
