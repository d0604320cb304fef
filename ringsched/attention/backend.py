"""Which kernels a stage attends with (`--attention-backend`), chosen once per stage by name.

- `torch`: decodes gathered in length groups, prefill chunks gathered, both attended by torch SDPA;
- `native`: decodes read in place by the CPU C kernel (`kernels/native.py`), prefill chunks as `torch`;
- `triton`: decodes and prefill chunks read in place by the Triton kernels (`kernels/triton_attention.py`); on a
  CPU they run under Triton's interpreter (slow: for tests);
- `auto`: `triton` on CUDA (`torch` where Triton is missing), `native` on CPU where the kernel builds for the KV
  dtype, else `torch` (what a CPU stage did before the choice existed).

A backend builds each micro-batch's description (`forward_batch`) and sets on it the function its layers attend
with (`ForwardBatch.attend`): the model's attention (`paged.paged_attention`) never asks which backend runs.
Under `--cp-size` the stage attends through `attention/cp_backend.py`'s `CPBackend`, which keeps the chosen
backend's `native_decode` for the decodes a rank holds.
"""

from __future__ import annotations

import importlib.util
import logging
import os

import torch

from ringsched.attention.batch import build_forward_batch, build_paged_batch
from ringsched.attention.paged import ForwardBatch
from ringsched.comm.messages import BatchPlan
from ringsched.config import ATTENTION_BACKENDS as BACKENDS
from ringsched.kernels import native, triton_attention
from ringsched.kv.cache import BlockTable

logger = logging.getLogger(__name__)


def check_backend(name: str) -> str:
    """`name` if it names a backend; otherwise a ValueError for the `--attention-backend` flag."""
    if name not in BACKENDS:
        raise ValueError(f"--attention-backend {name!r} is not a backend; choose one of {', '.join(BACKENDS)}")
    return name


class AttentionBackend:
    """How a stage's layers attend: `forward_batch` describes each micro-batch and sets the function its layers
    attend with; `native_decode`: decodes described for the CPU kernel (`build_forward_batch(native=True)`)."""

    # Every rank of a stage holds each micro-batch's rows, so a seam's shape follows from the plan (CP's does not)
    seam_from_plan = True

    def __init__(self, name: str, native_decode: bool = False) -> None:
        self.name, self.native_decode = name, native_decode

    @property
    def samples_here(self) -> bool:
        """Whether this rank samples the last stage's rows (under CP only the group's first rank does)."""
        return True

    def apply(self, plan: BatchPlan) -> None:
        """Take in a plan before its batch is built, on every rank in plan order (CP tracks its placement)."""

    def stats(self) -> dict:
        return {}

    def forward_batch(
        self, plan: BatchPlan, blocks: BlockTable, device: torch.device
    ) -> tuple[ForwardBatch, torch.Tensor]:
        """The micro-batch's description and its input ids `[T]`, attending with this backend."""
        return build_forward_batch(plan, blocks, device, self.native_decode)


class TritonBackend(AttentionBackend):
    def forward_batch(
        self, plan: BatchPlan, blocks: BlockTable, device: torch.device
    ) -> tuple[ForwardBatch, torch.Tensor]:
        batch, ids = build_paged_batch(plan, blocks, device)
        batch.attend = triton_attend
        return batch, ids


def select_backend(name: str, device: torch.device | str, kv_dtype: torch.dtype) -> AttentionBackend:
    """The backend `name` resolves to for a stage on `device` with KV in `kv_dtype`."""
    device = torch.device(device)
    if check_backend(name) == "auto":
        if device.type == "cuda":
            name = "triton" if triton_available() else "torch"
        else:
            name = "native" if native.usable_for(kv_dtype, device) else "torch"
    if name == "native" and not native.usable_for(kv_dtype, device):
        raise ValueError(
            f"--attention-backend native needs a CPU stage with float32 or bfloat16 KV and a C "
            f"compiler (here: {device.type}, {kv_dtype}); use auto or torch"
        )
    if name == "triton":
        if not triton_available():
            raise ValueError("--attention-backend triton needs the triton package (pip install triton, Linux only)")
        if device.type == "cpu":
            # Triton reads TRITON_INTERPRET when its kernels are decorated (the first import of
            # `kernels/triton_kernels.py`): set it first so CPU tensors run under the interpreter, not a GPU compiler.
            os.environ.setdefault("TRITON_INTERPRET", "1")
        logger.info("attention: triton kernels%s", " (interpreted on CPU: slow)" if device.type == "cpu" else "")
        return TritonBackend("triton")
    return AttentionBackend(name, native_decode=name == "native")


def triton_available() -> bool:
    # Looked up, not imported: on CPU, TRITON_INTERPRET has to be set before the first import.
    return importlib.util.find_spec("triton") is not None


def triton_attend(
    q: torch.Tensor, batch: ForwardBatch, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float
) -> torch.Tensor:
    """`ForwardBatch.attend` for the Triton backend: `[T, H, D]`, the decodes and the chunks in one call each."""
    dec, ext, bs = batch.paged_decodes, batch.paged_extends, batch.block_size
    if dec is not None and dec.all_rows:
        return triton_attention.paged_decode(q, k_cache, v_cache, dec.tables, dec.kv_lens, bs, scale, dec.max_kv_len)[0]
    out = torch.empty_like(q)
    if dec is not None:
        o, _ = triton_attention.paged_decode(
            q.index_select(0, dec.rows), k_cache, v_cache, dec.tables, dec.kv_lens, bs, scale, dec.max_kv_len
        )
        out.index_copy_(0, dec.rows, o)
    if ext is not None:
        triton_attention.paged_extend(
            q,
            k_cache,
            v_cache,
            ext.tables,
            ext.kv_lens,
            ext.rows,
            ext.q_lens,
            batch.positions,
            bs,
            scale,
            ext.max_q_len,
            out=out,
        )
    return out
