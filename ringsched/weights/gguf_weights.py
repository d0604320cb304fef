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
import re
from pathlib import Path

import numpy as np
import torch

from ringsched.kernels.gguf_linear import TYPES, column_bytes
from ringsched.weights.checkpoint_names import Source
from ringsched.weights.model_config import ModelConfig
from ringsched.weights.tp_shard import TPShard, check_tp

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

        from ringsched.weights.gguf_families import CONFIG_TENSORS, family_of
        from ringsched.weights.gguf_import import hf_tensors
        from ringsched.weights.gguf_meta import Meta

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
        self.unrun = sorted(
            {
                gguf.GGMLQuantizationType(q).name
                for _, q in self.tensors.values()
                if q not in TYPES and q not in FLOAT_TYPES
            }
        )
        if self.unrun:
            logger.warning(
                "%s: %s tensors are dequantized to float at load (the kernels run %s)",
                path.name,
                ", ".join(self.unrun),
                ", ".join(v[0] for v in TYPES.values()),
            )

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def names(self) -> list[str]:
        return list(self.tensors)

    def read(self, src: Source, part: tuple[int, int, int] | None, rows: int) -> tuple[torch.Tensor, int]:
        """(tensor, GGUF type): the parameter's blocks `[rows, row_bytes]` uint8 and its type where `gguf_linear`
        runs the type, else float32 values (type 0). `part`, `rows` and `src.row0` as `loader._read` takes them."""
        from ringsched.weights.gguf_import import _undone

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

        return np.ascontiguousarray(
            gguf.quants.dequantize(np.asarray(arr), gguf.GGMLQuantizationType(qtype)), dtype=np.float32
        )


ROW_PARALLEL = re.compile(r"\.(attn_output|ffn_down|ffn_down_exps)\.weight$")  # the tensors TP splits by columns


def check_kept(model_dir: Path, mcfg: ModelConfig, tp_size: int) -> None:
    """`--quantization gguf`, before any stage starts: the model was made from a GGUF file, and every rank's inputs
    of each row-parallel weight (o_proj, down_proj, experts' down) are whole blocks of its type; raises ValueError
    naming the flag and the fix."""
    import gguf

    path = gguf_file(model_dir)
    if path is None:
        raise ValueError(
            f"--quantization gguf: {model_dir} was not made from a GGUF file; give --model FILE.gguf "
            "(or the default model), or another --quantization"
        )
    if tp_size == 1:
        return
    blocks = {}  # row-parallel tensor -> its block's values
    for t in gguf.GGUFReader(str(path)).tensors:
        if ROW_PARALLEL.search(t.name) and int(t.tensor_type) in TYPES:
            blocks[t.name] = TYPES[int(t.tensor_type)]
    cut = _cut_block(mcfg, tp_size, blocks)
    if cut:
        fits = [n for n in range(1, 9) if _tp_fits(mcfg, n) and not _cut_block(mcfg, n, blocks)]
        name, values = cut
        raise ValueError(
            f"--tp-size {tp_size}: {name} is quantized in blocks of {values} inputs, which {tp_size} "
            f"ranks would cut; --tp-size {fits} keep them whole (or --quantization none)"
        )


def _tp_fits(mcfg: ModelConfig, tp: int) -> bool:
    try:
        check_tp(mcfg, tp)
    except ValueError:
        return False
    return True


def _cut_block(mcfg: ModelConfig, tp: int, blocks: dict[str, tuple[str, int, int]]) -> tuple[str, int] | None:
    """(tensor, block values) of the first row-parallel tensor whose blocks `tp` ranks would cut, or None."""
    for name, (_, values, _) in blocks.items():
        kind = ROW_PARALLEL.search(name).group(1)
        for rank in range(tp):
            shard = TPShard(rank, tp)
            if kind == "attn_output":
                first, n = shard.heads(mcfg)
                first, n = first * mcfg.head_dim, n * mcfg.head_dim
            else:
                first, n = shard.intermediate(mcfg) if kind == "ffn_down" else shard.expert_intermediate(mcfg)
            if first % values or n % values:
                return name, values
    return None
