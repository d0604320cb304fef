"""What the hardware decides: GPUs against local ranks, the dtype `auto` stands for, matmul precision, threads.

Pure functions (the GPU count, the checkpoint's dtype and the CPU set are passed in) so they are tested on a
CPU machine; the few lines that ask torch or the OS sit apart at the bottom.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

ONE_GPU_ENV = "RINGSCHED_ONE_GPU"  # "1": every rank on cuda:0, for checks of the NCCL ring (`stage/nccl.py`)
TF32_ENV = "RINGSCHED_TF32"  # "0": float32 matmuls on CUDA in full precision (gpu_check.sh's greedy check)
DTYPES = ("float32", "bfloat16", "float16")


def gpu_shortfall(pp_size: int, nnodes: int, tp_size: int, cp_size: int, visible: int) -> str | None:
    """None when this node has a GPU for each of its ranks, else the message that says which flags to change.
    Each local rank takes the GPU of its local index (`stage/worker.py`), so `visible` must be at least
    `pp_size / nnodes x tp_size x cp_size`."""
    local = pp_size // max(nnodes, 1) * tp_size * cp_size
    if local <= visible:
        return None
    return (
        f"--device cuda runs one rank per GPU: this node runs {local} ranks (--pp-size {pp_size} / --nnodes {nnodes} "
        f"x --tp-size {tp_size} x --cp-size {cp_size}) but sees {visible} GPU(s); lower --pp-size, --tp-size or "
        "--cp-size (or add nodes), or check CUDA_VISIBLE_DEVICES"
    )


def one_gpu() -> bool:
    """RINGSCHED_ONE_GPU=1: every rank of the node on its first GPU (a test mode: `docs/gpu.md`)."""
    return os.environ.get(ONE_GPU_ENV) == "1"


def gpu_index(local_rank: int) -> int:
    """The GPU a local rank takes: its own, or the first in the one-GPU mode."""
    return 0 if one_gpu() else local_rank


def resolve_dtype(requested: str, device: str, checkpoint: dict, fast_bf16: bool = False) -> str:
    """`--dtype auto`: the checkpoint's `torch_dtype` (or `dtype`) where the device computes it well. On a GPU, that
    dtype (bfloat16 when it names none or one we do not run). On a CPU, bfloat16 where the checkpoint is bfloat16
    and the CPU multiplies bfloat16 natively (`fast_bf16`: AVX512-BF16 or AMX), float32 otherwise (float16 has no
    fast CPU path; float32 is what the greedy-equality tests compare). An explicit dtype is kept."""
    if requested != "auto":
        return requested
    named = str(checkpoint.get("torch_dtype") or checkpoint.get("dtype") or "").removeprefix("torch.")
    if device != "cuda":
        return "bfloat16" if named == "bfloat16" and fast_bf16 else "float32"
    return named if named in DTYPES else "bfloat16"


def dtype_note(chosen: str, device: str, checkpoint: dict) -> str | None:
    """The log line for an `auto` dtype that is not the checkpoint's own, or None."""
    named = str(checkpoint.get("torch_dtype") or checkpoint.get("dtype") or "").removeprefix("torch.")
    if not named or named == chosen:
        return None
    why = f"{named} has no fast path here"
    if named == "bfloat16":
        why = "this CPU has no native bfloat16 (AVX512-BF16 or AMX)"
    return (
        f"--dtype auto: the checkpoint is {named}, running {chosen} on {device} ({why}); --dtype {named} runs it "
        "as it is"
    )


# Held back from a fractional --kv-cache-memory on a GPU before the fraction is taken: the allocator's slack,
# cuBLAS workspaces and NCCL buffers, then a step's activations (float32-sized, so any dtype fits).
GPU_FIXED_RESERVE = 1 << 30


def activation_reserve(step_tokens: int, sampled_rows: int, hidden: int, intermediate: int, vocab: int) -> int:
    """Bytes a GPU keeps out of a fractional KV budget: a fixed reserve, plus for every token of the largest step
    its hidden states, residual, q/k/v/o and gate/up widths live at once, plus the logits of its sampled rows."""
    per_token = 4 * (6 * hidden + 3 * intermediate)
    return GPU_FIXED_RESERVE + step_tokens * per_token + sampled_rows * vocab * 4


def usable_cpus(affinity: set[int] | None, cpu_count: int | None) -> int:
    """CPUs this process may run on: its affinity mask (taskset, cgroups via SLURM) when the OS gives one, else
    the machine's count."""
    return len(affinity) if affinity else max(cpu_count or 1, 1)


# -- the lines that ask the machine ------------------------------------------------------------------------------
def cpus_here() -> int:
    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    return usable_cpus(affinity, os.cpu_count())


def cpu_has_fast_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512-BF16 or AMX-BF16 in /proc/cpuinfo's flags)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return "avx512_bf16" in flags or "amx_bf16" in flags


def read_checkpoint_config(model: str) -> dict:
    """A model directory's config.json, or {} when `model` is not a directory yet (a known name before its fetch)."""
    path = Path(model) / "config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def set_matmul_precision(device: torch.device) -> None:
    """TF32 for float32 matmuls on CUDA (as vLLM and SGLang run), unless RINGSCHED_TF32=0; CPU unchanged."""
    if device.type == "cuda":
        on = os.environ.get(TF32_ENV, "1") != "0"
        torch.backends.cuda.matmul.allow_tf32 = on
        torch.backends.cudnn.allow_tf32 = on
