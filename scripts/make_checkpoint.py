"""A random-weight checkpoint of a real model's shape, to load and serve a model of real size without a hub.

Writes config.json (the named model's shape), a byte-level tokenizer with the chat template, and the weights as
sharded safetensors (`model-0000k-of-0000n.safetensors` + `model.safetensors.index.json`, as hubs ship them),
generated a tensor at a time so the writer never holds more than one shard. Names and shapes come from ringsched's
own model on the meta device, so the checkpoint is exactly what the loader reads.

    python scripts/make_checkpoint.py --like llama-3.1-8b --out /tmp/llama8b            # 16 GB, bfloat16
    python scripts/make_checkpoint.py --like qwen3-8b --out /tmp/qwen3-8b --layers 8     # fewer layers
    python scripts/make_checkpoint.py --like qwen3-30b-a3b --out /tmp/q30 --layers 8     # a mixture of experts, scaled
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from ringsched.models.checkpoint_check import expected_shapes
from ringsched.models.random_model import CHAT_TEMPLATE, byte_tokenizer
from ringsched.weights.model_config import ModelConfig
from ringsched.weights.tokenizer_build import write_tokenizer_files

LIKE = {
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "vocab_size": 128256, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
        "max_position_embeddings": 131072, "tie_word_embeddings": False,
    },
    "qwen3-8b": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288,
        "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "vocab_size": 151936, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 40960,
        "tie_word_embeddings": False,
    },
    "qwen2.5-7b": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944,
        "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4, "head_dim": 128,
        "vocab_size": 152064, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
    },
    "mistral-7b-v0.1": {
        "architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "vocab_size": 32000, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 32768,
        "sliding_window": 4096, "tie_word_embeddings": False,
    },
    "gemma-2-9b": {
        "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "hidden_size": 3584, "intermediate_size": 14336,
        "num_hidden_layers": 42, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256,
        "vocab_size": 256000, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 8192,
        "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 256, "sliding_window": 4096,
        "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "tie_word_embeddings": True,
    },
    "mixtral-8x7b": {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "vocab_size": 32000, "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "max_position_embeddings": 32768,
        "num_local_experts": 8, "num_experts_per_tok": 2, "tie_word_embeddings": False,
    },
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
        "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
        "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "max_position_embeddings": 40960, "num_experts": 128, "num_experts_per_tok": 8,
        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "tie_word_embeddings": False,
    },
}  # fmt: skip
SHARD_BYTES = 4 << 30


def write_weights(out: Path, cfg: ModelConfig, dtype: torch.dtype, seed: int) -> int:
    """Every tensor, random (norms 1), in shards of at most `SHARD_BYTES` written as each fills (one in memory);
    returns the bytes written."""
    shapes = expected_shapes(cfg)
    gen = torch.Generator().manual_seed(seed)
    files: list[list[str]] = []  # tensor names of each shard written
    shard, size, total = {}, 0, 0
    for name, shape in shapes.items():
        t = torch.ones(shape, dtype=dtype) if name.endswith("norm.weight") else \
            (torch.randn(shape, generator=gen) * 0.02).to(dtype)  # fmt: skip
        if shard and size + t.nbytes > SHARD_BYTES:
            files.append(_save(out, shard, len(files)))
            shard, size = {}, 0
        shard[name], size, total = t, size + t.nbytes, total + t.nbytes
    files.append(_save(out, shard, len(files)))
    names = [f"model-{k + 1:05d}-of-{len(files):05d}.safetensors" for k in range(len(files))]
    for k, name in enumerate(names):  # the hub's names say how many shards there are: known only now
        (out / f"part-{k}.safetensors").rename(out / name)
    index = {"metadata": {"total_size": total}, "weight_map": {t: names[k] for k, ts in enumerate(files) for t in ts}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    return total


def _save(out: Path, shard: dict[str, torch.Tensor], k: int) -> list[str]:
    save_file(shard, str(out / f"part-{k}.safetensors"), metadata={"format": "pt"})
    return list(shard)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--like", choices=sorted(LIKE), required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--layers", type=int, default=None, help="fewer layers than the real model (scaled to fit)")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    config = {**LIKE[args.like], "torch_dtype": args.dtype, "bos_token_id": 1, "eos_token_id": 2}
    if args.layers:
        config["num_hidden_layers"] = args.layers
    cfg = ModelConfig.from_dict(config)
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    total = write_weights(args.out, cfg, getattr(torch, args.dtype), args.seed)
    (args.out / "config.json").write_text(json.dumps(config, indent=2))
    (args.out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    tok, tokens = byte_tokenizer(cfg.vocab_size)
    write_tokenizer_files(args.out, tok, tokens, 1, 2, 0, None, CHAT_TEMPLATE, min(cfg.max_position_embeddings, 8192))
    print(f"{args.out}: {args.like}, {cfg.num_layers} layers, {total / 1e9:.2f} GB of {args.dtype} weights in "
          f"{time.monotonic() - t0:.0f} s")  # fmt: skip


if __name__ == "__main__":
    main()
