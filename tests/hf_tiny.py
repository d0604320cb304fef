"""Tiny random models made by transformers' own classes, saved as a checkpoint ringsched loads (with a byte-level
tokenizer), for tests that compare the two on the same weights."""

from __future__ import annotations

from pathlib import Path

import torch

from ringsched.models.random_model import CHAT_TEMPLATE, byte_tokenizer
from ringsched.weights.tokenizer_build import write_tokenizer_files

SIZES = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2)  # fmt: skip


def save_tiny(out: Path, config_class, model_class, seed: int = 0, **fields):
    """A `model_class` of `config_class(**SIZES, **fields)`, its norms' weights randomised too (an identity norm
    would hide a norm read wrong), saved to `out`; returns `(out, the transformers model)`."""
    torch.manual_seed(seed)
    hf = model_class(config_class(**{**SIZES, **fields})).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.normal_(0, 0.3)
    hf.save_pretrained(str(out))
    tok, tokens = byte_tokenizer(hf.config.vocab_size)
    write_tokenizer_files(out, tok, tokens, 1, 2, 0, None, CHAT_TEMPLATE, hf.config.max_position_embeddings)
    return out, hf
