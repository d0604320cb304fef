"""Random-weight models in the same directory layout, so benchmarks can use models of any size."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from tokenizers.pre_tokenizers import ByteLevel

from ringsched.layout.rank import StageInfo
from ringsched.models.llama import StageModel
from ringsched.weights.model_config import ModelConfig
from ringsched.weights.tokenizer_build import write_tokenizer_files

ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def random_config(
    arch: str,
    layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    intermediate: int,
    vocab: int,
    tie: bool,
    max_len: int = 4096,
) -> dict:
    if arch not in ARCHS:
        raise ValueError(f"--arch {arch!r} is not one of {', '.join(ARCHS)}")
    if vocab < 256 + len(SPECIALS):
        raise ValueError(f"--vocab must be at least {256 + len(SPECIALS)} (the byte tokens plus specials)")
    if hidden % heads:
        raise ValueError(f"--hidden {hidden} must be a multiple of --heads {heads}")
    return {
        "architectures": [ARCHS[arch]],
        "model_type": arch,
        "num_hidden_layers": layers,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": max_len,
        "tie_word_embeddings": tie,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }


def byte_tokenizer(vocab_size: int) -> tuple[Tokenizer, list[str]]:
    """Specials, the 256 byte symbols, then printable filler tokens up to `vocab_size` (decodable, never
    produced by encoding)."""
    byte_syms = sorted(ByteLevel.alphabet())
    tokens = SPECIALS + byte_syms
    tokens += [f"<x{i}>" for i in range(len(tokens), vocab_size)]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    return tok, tokens


def write_random_model(out: Path, config: dict, seed: int = 0) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    cfg = ModelConfig.from_dict(config)
    torch.manual_seed(seed)
    model = StageModel(cfg, StageInfo(0, 1, 0, cfg.num_layers))
    std = 0.02
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.normal_(0, std)
            else:
                p.normal_(0, std)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    tok, tokens = byte_tokenizer(cfg.vocab_size)
    write_tokenizer_files(out, tok, tokens, 1, 2, 0, None, CHAT_TEMPLATE, config["max_position_embeddings"])
    return out
