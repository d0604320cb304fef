"""What the planner knows about models and GPUs.

Contract: `load_model(name_or_dir)` returns a `ModelSpec` from a built-in preset or from a model
directory's HF `config.json`; `load_gpu(name)` returns a `GpuSpec` preset. Both raise `CapacityError` with a
message that names the flag and the fix. Every field can be overridden afterwards with `dataclasses.replace`,
which re-validates.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

GIB = 2**30


class CapacityError(ValueError):
    """Input the planner cannot use; the message names the flag and what to do."""


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a dense decoder-only model, as far as memory and traffic are concerned."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_embeddings: bool
    dtype_bytes: int = 2
    qkv_bias: bool = False  # Qwen2 has biases on q, k and v
    qk_norm: bool = False  # Qwen3 has an RMSNorm of head_dim on q and on k

    def __post_init__(self) -> None:
        for flag, value in (
            ("--num-layers", self.num_layers),
            ("--hidden-size", self.hidden_size),
            ("--num-heads", self.num_heads),
            ("--num-kv-heads", self.num_kv_heads),
            ("--head-dim", self.head_dim),
            ("--intermediate-size", self.intermediate_size),
            ("--vocab-size", self.vocab_size),
        ):
            if not isinstance(value, int) or value < 1:
                raise CapacityError(f"{flag} must be a positive integer, got {value!r} (model {self.name})")
        if self.num_heads % self.num_kv_heads:
            raise CapacityError(
                f"--num-kv-heads {self.num_kv_heads} does not divide --num-heads {self.num_heads} (model "
                f"{self.name}); grouped-query attention needs the head count to be a multiple of the KV heads"
            )
        if self.dtype_bytes not in (1, 2, 4):
            raise CapacityError(f"--dtype-bytes must be 1 (fp8),2 (bf16) or 4 (fp32), not {self.dtype_bytes}")


@dataclass(frozen=True)
class GpuSpec:
    """One GPU: memory as the device reports it (the base of --mem-fraction), and its bandwidths."""

    name: str
    memory_gib: float
    hbm_tb_per_s: float  # decimal TB/s, as datasheets give it
    intra_node_gb_per_s: float  # decimal GB/s per direction, GPU to GPU inside one node

    def __post_init__(self) -> None:
        for flag, value in (
            ("--gpu-memory-gib", self.memory_gib),
            ("--hbm-tb-per-s", self.hbm_tb_per_s),
            ("--intra-node-gb-per-s", self.intra_node_gb_per_s),
        ):
            if not value > 0:
                raise CapacityError(f"{flag} must be positive, got {value!r} (GPU {self.name})")


# Shapes from each model's published HF config.json.
MODEL_PRESETS: dict[str, ModelSpec] = {
    # meta-llama/Meta-Llama-3-8B
    "llama-3-8b": ModelSpec("llama-3-8b", 32, 4096, 32, 8, 128, 14336, 128256, False),
    # meta-llama/Meta-Llama-3-70B: 131.4 GiB in bf16, the design document's worked example
    "llama-3-70b": ModelSpec("llama-3-70b", 80, 8192, 64, 8, 128, 28672, 128256, False),
    # meta-llama/Llama-3.1-405B
    "llama-3-405b": ModelSpec("llama-3-405b", 126, 16384, 128, 8, 128, 53248, 128256, False),
    # Qwen/Qwen3-32B: 64 x 128 = 8192 attention width on a 5120 residual stream
    "qwen3-32b": ModelSpec("qwen3-32b", 64, 5120, 64, 8, 128, 25600, 151936, False, qk_norm=True),
    # HuggingFaceTB/SmolLM2-135M-Instruct: the repo's end-to-end test model
    "smollm2-135m-instruct": ModelSpec("smollm2-135m-instruct", 30, 576, 9, 3, 64, 1536, 49152, True),
}

# memory_gib is nvidia-smi's memory.total in GiB (the total cudaMemGetInfo gives, which vLLM multiplies by
# --gpu-memory-utilization), not the marketing figure: the driver keeps part of the memory for itself. Kept to
# two decimals, as the design document quotes the H100's (79.65 GiB, so 0.9 of it is 71.69 GiB).
GPU_PRESETS: dict[str, GpuSpec] = {
    # NVIDIA H100 Tensor Core GPU datasheet (SXM5): 80 GB HBM3, 3.35 TB/s, NVLink 900 GB/s bidirectional.
    # Reported: 81559 MiB = 79.65 GiB (the design document's §2.1 figure).
    "h100-sxm-80gb": GpuSpec("h100-sxm-80gb", 79.65, 3.35, 900 / 2),
    # NVIDIA H200 Tensor Core GPU datasheet (SXM): 141 GB HBM3e, 4.8 TB/s, NVLink 900 GB/s bidirectional.
    # Reported: 143771 MiB = 140.40 GiB.
    "h200-141gb": GpuSpec("h200-141gb", 140.40, 4.8, 900 / 2),
    # NVIDIA A100 Tensor Core GPU datasheet (80GB SXM): HBM2e 2,039 GB/s, NVLink 600 GB/s bidirectional.
    # Reported: 81920 MiB = 80.00 GiB.
    "a100-80gb": GpuSpec("a100-80gb", 80.00, 2.039, 600 / 2),
    # NVIDIA L40S datasheet: 48 GB GDDR6, 864 GB/s; no NVLink, GPUs talk over PCIe Gen4 x16 at 64 GB/s
    # bidirectional. Reported: 46068 MiB = 44.99 GiB.
    "l40s-48gb": GpuSpec("l40s-48gb", 44.99, 0.864, 64 / 2),
}

# HF torch_dtype (or the newer `dtype`) to bytes per element.
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1, "float8_e5m2": 1}
# Dense families whose weights and KV the arithmetic here counts (Gemma's extra norms and Phi-3's fused projections
# change no size that matters; a sliding layer's KV is held whole, as the engine's pool holds it)
_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "Phi3ForCausalLM",
)


def load_gpu(name: str) -> GpuSpec:
    """A GPU preset by name."""
    try:
        return GPU_PRESETS[name]
    except KeyError:
        raise CapacityError(
            f"unknown --gpu {name!r}; use one of {', '.join(GPU_PRESETS)}, or the closest one with "
            "--gpu-memory-gib, --hbm-tb-per-s and --intra-node-gb-per-s to override its figures"
        ) from None


def load_model(name_or_dir: str) -> ModelSpec:
    """A model preset by name, or the shape read from `<dir>/config.json` (or a path to a config.json)."""
    if name_or_dir in MODEL_PRESETS:
        return MODEL_PRESETS[name_or_dir]
    path = Path(name_or_dir)
    config = path / "config.json" if path.is_dir() else path
    if path.exists() and config.is_file():
        return model_from_config(json.loads(config.read_text()), name=path.name)
    raise CapacityError(
        f"unknown --model {name_or_dir!r}: not a preset ({', '.join(MODEL_PRESETS)}) and not a directory "
        "holding a config.json; give a preset name or a model directory"
    )


def model_from_config(cfg: dict, name: str = "config.json") -> ModelSpec:
    """Read a HF config dict of a dense family (`_ARCHITECTURES`); mixtures of experts are refused."""
    archs = cfg.get("architectures") or ["LlamaForCausalLM"]
    arch = archs[0]
    if arch not in _ARCHITECTURES:
        # MoE and hybrid models need other arithmetic; better no answer than a wrong one.
        raise CapacityError(
            f"--model {name}: architecture {arch} is not one the planner can count "
            f"({', '.join(_ARCHITECTURES)}); "
            "use the closest preset and override its shape with --num-layers, --hidden-size, ..."
        )
    dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
    if dtype not in _DTYPE_BYTES:
        raise CapacityError(f"--model {name}: torch_dtype {dtype!r} is not known; pass --dtype-bytes")
    try:
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        return ModelSpec(
            name=name,
            num_layers=cfg["num_hidden_layers"],
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            intermediate_size=cfg["intermediate_size"],
            vocab_size=cfg["vocab_size"],
            tie_embeddings=bool(cfg.get("tie_word_embeddings", arch.startswith("Gemma"))),
            dtype_bytes=_DTYPE_BYTES[dtype],
            # Qwen2 always carries q/k/v biases; Llama-family configs say so in attention_bias.
            qkv_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
        )
    except KeyError as missing:
        raise CapacityError(f"--model {name}: config.json has no {missing}, which sizing the model needs") from None
