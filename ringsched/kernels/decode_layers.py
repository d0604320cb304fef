"""A stage's decoder layers for a decode step of a few rows on CPU, as one native call (`decode_layers.c`).

`DecoderLayer._small_step` already runs a small step as nine native calls a layer (two RMSNorms, four linear
layers, rotary with the KV writes, decode attention, SiLU x up), but from Python: on SmolLM2 at one request the
Python between those calls (module calls, allocations, ctypes conversions) was ~3 ms of a 26 ms step on two
cores. Here one call runs every layer of the step: the same kernels (reached through function pointers into their
own libraries, so each keeps its compile flags), in the same order, on the same buffers, so the results are the
Python path's bit for bit (`tests/test_decode_layers.py`).

It applies where every row is a decode that the attention kernel reads in place (`NativeDecode.all_rows`), at a
row count for which every linear layer's path (`Linear.paths`: fixed thresholds, or the stage's measured choice,
`kernels/linear_tuning.py`) is the kernel and at most `layer_ops.MAX_ROWS`, with layers whose small step takes the
native `layer_ops` (`DecoderLayer.step_ops`), without tensor or context parallelism. Anything else takes the
per-layer path. `RINGSCHED_DECODE_LAYERS=0` turns it off (the per-layer path runs the same kernels);
`RINGSCHED_NATIVE_LINEAR=0` turns it off with the kernels.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

from ringsched.kernels import gguf_linear, layer_ops, native, native_build, small_linear

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("decode_layers.c")
# Sequencing and the bfloat16 conversions only (rounded as torch rounds): no fast-math, no contraction.
COMPILE_FLAGS = ["-O2", "-ffp-contract=off", "-fPIC", "-c"]
LINK_FLAGS = ["-shared"]

_Y_WORDS = 4 + 4 * 7  # a layer's words in the descriptor: norms, caches, four linear layers (decode_layers.c)


def library() -> tuple[ctypes.CDLL, ctypes.Array] | None:
    """The driver and the kernels' addresses, or None (a kernel missing, no compiler, or switched off)."""
    return LIBRARY.get()


def _declare(lib: ctypes.CDLL) -> tuple[ctypes.CDLL, ctypes.Array]:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.decode_layers.argtypes = [ptr, ptr, ptr, ptr, i64, i64, ptr, ptr, ptr, ctypes.c_float, i64, i64, i64]
    lib.decode_layers.restype = ctypes.c_int
    linear, ops, attention = small_linear.library(), layer_ops.library(), native._library()
    kept = gguf_linear.library()
    fns = [
        linear.linear_kn,
        linear.linear_nk,
        ops.add_rmsnorm,
        ops.rope_store,
        ops.silu_mul,
        attention.paged_decode,
        kept.gguf_linear,
        kept.gguf_linear_parts,
    ]
    return lib, (ctypes.c_void_p * len(fns))(*[ctypes.cast(f, ctypes.c_void_p).value for f in fns])


LIBRARY = native_build.NativeLibrary(
    SOURCE,
    COMPILE_FLAGS,
    LINK_FLAGS,
    logger,
    "decode layers",
    "running layer by layer",
    _declare,
    "RINGSCHED_DECODE_LAYERS",
    needs=(small_linear.library, layer_ops.library, native._library, gguf_linear.library),
)


class DecodeLayers:
    """The descriptor of a stage's layers (weights, norms, caches: addresses that do not move), built once for a
    KV pool, and the step call."""

    def __init__(self, model) -> None:
        stage = model.stage
        self.start = stage.start_layer
        held = [model.model.layers[i] for i in range(stage.start_layer, stage.end_layer)]
        self.layers = held
        # plain layers (not MoE, Gemma) on the native layer ops
        self.ok = bool(held) and all(getattr(y, "step_ops", None) is layer_ops for y in held)
        if not self.ok:
            return
        attn = held[0].self_attn
        lins = [lin for y in held for lin in (y.self_attn.qkv, y.self_attn.o_proj, y.mlp.gate_up, y.mlp.down_proj)]
        # (`small_ops` layers have their q/k/v and gate/up fused: none of these is None)
        # the row counts whose every linear call the kernel takes: the one call runs the kernel alone
        self.rows = frozenset(
            t for t in range(1, layer_ops.MAX_ROWS + 1) if all(lin.paths.path(t) == small_linear.NATIVE for lin in lins)
        )
        self.ok = not any(lin.sums_over_ranks for y in held for lin in (y.self_attn.o_proj, y.mlp.down_proj)) and bool(
            self.rows
        )
        if not self.ok:
            return
        self.max_rows = max(self.rows)
        self.dtype = held[0].input_layernorm.weight.dtype
        self.heads, self.kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.hidden = held[0].input_layernorm.weight.shape[0]
        self.inter = held[0].mlp.down_proj.in_features  # not its weight's shape: int4 packs two a byte
        self.scale = attn.scale
        self.rotary = attn.rotary
        self.eps = torch.tensor(
            [[y.input_layernorm.eps, y.post_attention_layernorm.eps] for y in held], dtype=torch.float32
        )
        self._desc: torch.Tensor | None = None
        self._caches_key: tuple | None = None
        self._all: tuple[range, torch.Tensor] | None = None

    def takes(self, batch) -> bool:
        """Whether a step of `batch` runs here: every row a decode the attention kernel reads in place, a row count
        in `rows`."""
        nd = batch.native_decode
        return self.ok and nd is not None and nd.all_rows and batch.num_tokens in self.rows and library() is not None

    def usable(self, batch, hidden: torch.Tensor, residual: torch.Tensor | None, kv_caches) -> bool:
        return (
            kv_caches is not None
            and self.takes(batch)
            and hidden.shape[0] == batch.num_tokens
            and hidden.dtype == self.dtype
            and hidden.is_contiguous()
            and (residual is None or residual.is_contiguous())
        )

    def _descriptor(self, kv_caches) -> torch.Tensor:
        key = (id(kv_caches), kv_caches[0][0].data_ptr())
        if self._desc is None or self._caches_key != key:
            rows = []
            for y, (kc, vc) in zip(self.layers, kv_caches, strict=True):
                a, m = y.self_attn, y.mlp
                words = [
                    y.input_layernorm.weight.data_ptr(),
                    y.post_attention_layernorm.weight.data_ptr(),
                    kc.data_ptr(),
                    vc.data_ptr(),
                ]
                for lin in (a.qkv, a.o_proj, m.gate_up, m.down_proj):
                    words += lin.native_words()
                rows.append(words)
            self._desc = torch.tensor(rows, dtype=torch.int64)
            assert self._desc.shape[1] == _Y_WORDS
            self._kv_bf16 = int(kv_caches[0][0].dtype == torch.bfloat16)
            self._caches_key = key
        return self._desc

    def __call__(self, batch, hidden: torch.Tensor, residual: torch.Tensor | None, kv_caches, layers) -> tuple:
        """The layers `layers` (global indices, in order) over the step: (output, residual), as the per-layer loop
        returns them."""
        lib, fns = library()
        desc = self._descriptor(kv_caches)
        # `StageModel.forward` passes the stage's whole range every step: its indices are made once
        if self._all is None or layers != self._all[0]:
            self._all = (layers, torch.tensor([i - self.start for i in layers], dtype=torch.int64))
        idx = self._all[1]
        nd, t, dt = batch.native_decode, hidden.shape[0], self.dtype
        scratch = self._scratch(t)
        bufs = (ctypes.c_void_p * 12)(
            hidden.data_ptr(),
            0 if residual is None else residual.data_ptr(),
            *[0 if s is None else s.data_ptr() for s in scratch],
        )
        dims = [self.hidden, self.heads, self.kv_heads, self.head_dim, self.inter]
        dims = torch.tensor([*dims, nd.block_size, nd.tables.shape[1], nd.max_len], dtype=torch.int64)
        cos, sin = self.rotary.tables(batch.positions, batch.position_bound)
        step = [batch.positions, batch.slot_mapping, nd.tables, nd.lens, cos, sin]
        step = torch.tensor([x.data_ptr() for x in step], dtype=torch.int64)
        rc = lib.decode_layers(
            fns,
            desc.data_ptr(),
            self.eps.data_ptr(),
            idx.data_ptr(),
            idx.numel(),
            t,
            dims.data_ptr(),
            step.data_ptr(),
            bufs,
            self.scale,
            int(dt == torch.bfloat16),
            self._kv_bf16,
            torch.get_num_threads(),
        )
        if rc != 0:  # paged_decode: no memory for a thread's score buffer; a linear layer: a weight dtype it lacks
            raise RuntimeError(f"decode_layers: a kernel returned {rc}")
        out = scratch[8] if idx.numel() % 2 else scratch[9]  # the layers' outputs alternate between the two
        return out, hidden if residual is None else residual

    def _scratch(self, t: int) -> list[torch.Tensor | None]:
        """The step's working buffers for `t` rows, in `decode_layers.c`'s order (None: not needed in float32)."""
        dt, f32, h, kvh, d = self.dtype, torch.float32, self.heads, self.kv_heads, self.head_dim
        return [
            torch.empty(t, (h + 2 * kvh) * d, dtype=dt),
            torch.empty(t, h, d, dtype=dt),
            torch.empty(t, h, d, dtype=f32) if dt != f32 else None,
            torch.empty(t, h, d, dtype=f32),
            torch.empty(t, h * d, dtype=dt) if dt != f32 else None,
            torch.empty(t, self.hidden, dtype=dt),
            torch.empty(t, 2 * self.inter, dtype=dt),
            torch.empty(t, self.inter, dtype=dt),
            torch.empty(t, self.hidden, dtype=dt),
            torch.empty(t, self.hidden, dtype=dt),
        ]
