"""Turn a Llama-architecture GGUF file into a Hugging Face-layout model directory.

Dequantizes every tensor to float32 with the `gguf` package, renames it to the Hugging Face name, and undoes
the permutation llama.cpp's converter applies to the Q and K projections (it interleaves the two rotary
halves of each head; Hugging Face's rotate-half RoPE expects them split). Without that undo the model talks
nonsense.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from ringsched.models.tokenizer_build import build_bpe_tokenizer, write_tokenizer_files

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def unpermute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute`: rows of each head go from (d/2, 2) interleaved to (2, d/2)."""
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_name(gguf_name: str) -> str:
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", gguf_name)
    if not m or m.group(2) not in _LAYER_NAMES:
        raise ValueError(
            f"unexpected GGUF tensor {gguf_name!r}; only Llama-architecture GGUF files are supported"
        )
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def convert_gguf(gguf_path: Path, out_dir: Path, quiet: bool = False) -> Path:
    """One pass from a GGUF file to a Hugging Face-layout directory: config, tensors (Q and K un-permuted from
    llama.cpp's rotary layout), tokenizer."""
    import gguf  # imported here: only the converter needs it

    reader = gguf.GGUFReader(str(gguf_path))
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"{gguf_path.name}: GGUF architecture {arch!r} is not supported; only 'llama' is")
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = _dequantized(reader, quiet)
    config = _hf_config(reader, tensors)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    gen = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"], "do_sample": False}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2))
    _write_tokenizer(reader, out_dir, config["max_position_embeddings"])
    return out_dir


def _heads(reader) -> tuple[int, int]:
    n_heads = int(_field(reader, "llama.attention.head_count"))
    return n_heads, int(_field(reader, "llama.attention.head_count_kv", n_heads))


def _dequantized(reader, quiet: bool) -> dict[str, torch.Tensor]:
    """Every tensor in float32 under its Hugging Face name, Q and K in the Hugging Face rotary layout."""
    import gguf

    n_heads, n_kv = _heads(reader)
    tensors: dict[str, torch.Tensor] = {}
    total = len(reader.tensors)
    for i, t in enumerate(reader.tensors, 1):
        arr = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        name = hf_name(t.name)
        if name.endswith("q_proj.weight"):
            arr = unpermute_rotary(arr, n_heads)
        elif name.endswith("k_proj.weight"):
            arr = unpermute_rotary(arr, n_kv)
        tensors[name] = torch.from_numpy(np.ascontiguousarray(arr))
        if not quiet and (i % 16 == 0 or i == total):
            print(f"\rdequantizing tensors {i}/{total}", end="", file=sys.stderr, flush=True)
    if not quiet:
        print(file=sys.stderr)
    return tensors


def _hf_config(reader, tensors: dict[str, torch.Tensor]) -> dict:
    """config.json from the file's metadata; the lm_head is tied when the file has none."""
    n_heads, n_kv = _heads(reader)
    hidden = int(_field(reader, "llama.embedding_length"))
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_hidden_layers": int(_field(reader, "llama.block_count")),
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, "llama.feed_forward_length")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": hidden // n_heads,
        "vocab_size": int(_field(reader, "llama.vocab_size", tensors["model.embed_tokens.weight"].shape[0])),
        "rms_norm_eps": float(_field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(_field(reader, "llama.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_field(reader, "llama.context_length", 4096)),
        "tie_word_embeddings": "lm_head.weight" not in tensors,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "hidden_act": "silu",
        "attention_bias": False,
        "torch_dtype": "float32",
    }


def _write_tokenizer(reader, out_dir: Path, max_len: int) -> None:
    model = _field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"GGUF tokenizer model {model!r} is not supported; only byte-level BPE ('gpt2') is")
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    merges = list(_field(reader, "tokenizer.ggml.merges"))
    types = [int(t) for t in _field(reader, "tokenizer.ggml.token_type")]
    tok = build_bpe_tokenizer(tokens, merges, types)
    write_tokenizer_files(
        out_dir,
        tok,
        tokens,
        bos_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        pad_id=_field(reader, "tokenizer.ggml.padding_token_id"),
        unk_id=_field(reader, "tokenizer.ggml.unknown_token_id"),
        chat_template=_field(reader, "tokenizer.chat_template"),
        max_len=max_len,
    )
