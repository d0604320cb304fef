"""Build a Hugging Face `tokenizer.json` from a GGUF file's byte-level BPE vocabulary and merges."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

# llama.cpp token types: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
_SPECIAL_TYPES = (3, 4)


def build_bpe_tokenizer(tokens: list[str], merges: list[str], token_types: list[int]) -> Tokenizer:
    """Byte-level BPE as GPT-2 style GGUF models ("gpt2" tokenizer model) store it."""
    vocab = {tok: i for i, tok in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    special = [
        AddedToken(tokens[i], special=True, normalized=False)
        for i, t in enumerate(token_types)
        if t in _SPECIAL_TYPES
    ]
    tok.add_special_tokens(special)
    return tok


def write_tokenizer_files(
    out_dir: Path,
    tokenizer: Tokenizer,
    tokens: list[str],
    bos_id: int | None,
    eos_id: int | None,
    pad_id: int | None,
    unk_id: int | None,
    chat_template: str | None,
    max_len: int,
) -> None:
    tokenizer.save(str(out_dir / "tokenizer.json"))

    def name(i: int | None) -> str | None:
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": name(bos_id),
        "eos_token": name(eos_id),
        "pad_token": name(pad_id),
        "unk_token": name(unk_id),
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_len,
    }
    if chat_template:
        cfg["chat_template"] = chat_template
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False))
