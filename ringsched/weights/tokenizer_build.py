"""Build a Hugging Face `tokenizer.json` from a GGUF file's vocabulary: byte-level BPE (llama.cpp's "gpt2" tokenizer
model: vocabulary and merges) or SentencePiece BPE ("llama": vocabulary, scores and token types)."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

# llama.cpp token types: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
_SPECIAL_TYPES = (3, 4)
_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4
SPACE = "\u2581"  # SentencePiece's "▁", which stands for a space in its pieces


def build_bpe_tokenizer(
    tokens: list[str], merges: list[str], token_types: list[int], split: str | None = None
) -> Tokenizer:
    """Byte-level BPE as GPT-2 style GGUF models ("gpt2" tokenizer model) store it. `split`: the regex that cuts
    text into words before the merges (Llama 3's, Qwen2's); None: GPT-2's own."""
    vocab = {tok: i for i, tok in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if split is not None:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    special = [
        AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(token_types) if t in _SPECIAL_TYPES
    ]
    tok.add_special_tokens(special)
    return tok


def build_spm_tokenizer(
    tokens: list[str],
    scores: list[float],
    token_types: list[int],
    unk_id: int | None,
    add_space_prefix: bool,
    merges: list[str] | None = None,
) -> Tokenizer:
    """SentencePiece BPE as llama.cpp stores it ("llama" tokenizer model: Llama 2, Mistral, Phi-3, Gemma) and
    tokenizes it: spaces become "▁", and where `add_space_prefix` a "▁" is prepended to the text and after each
    control token (the normalizer runs on each stretch between them); characters outside the vocabulary fall
    back to their `<0xXX>` byte tokens. Control tokens are special, user-defined ones matched whole. The merges
    are the file's, or `spm_merges`."""
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    pairs = [tuple(m.split(" ", 1)) for m in merges] if merges else spm_merges(tokens, scores, token_types)
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, unk_token=unk, fuse_unk=True, byte_fallback=True))
    prefix = [normalizers.Prepend(SPACE)] if add_space_prefix else []
    tok.normalizer = normalizers.Sequence([*prefix, normalizers.Replace(" ", SPACE)])
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if add_space_prefix else []))
    kinds = list(zip(tokens, token_types, strict=False))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in kinds if k == _CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in kinds if k == _USER_DEFINED])
    return tok


def spm_merges(tokens: list[str], scores: list[float], token_types: list[int]) -> list[tuple[str, str]]:
    """The merges a SentencePiece BPE vocabulary implies: every cut of a normal token into two normal tokens,
    ranked by the merged token's score, best first (ties in vocabulary order). SentencePiece (and llama.cpp)
    merge, at each step, the adjacent pair whose union scores best; ranked so, Hugging Face's BPE picks the same."""
    normal = {t: i for i, t in enumerate(tokens) if i >= len(token_types) or token_types[i] == _NORMAL}
    ranked = []
    for piece, i in normal.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in normal and right in normal:
                ranked.append((-scores[i], i, normal[left], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


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
    add_bos: bool = False,
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
        "add_bos_token": add_bos,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_len,
    }
    if chat_template:
        cfg["chat_template"] = chat_template
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False))
