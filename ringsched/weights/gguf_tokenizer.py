"""The tokenizer a GGUF file describes, written as Hugging Face tokenizer files (`tokenizer.json`,
`tokenizer_config.json` with the file's chat template), and the ids that end a generation.

Two of llama.cpp's tokenizer models: "gpt2" (byte-level BPE: Llama 3, Qwen, SmolLM; the words cut by the regex
`tokenizer.ggml.pre` names) and "llama" (SentencePiece BPE: Llama 2, Mistral, Phi-3, Gemma; merges derived from
the scores). Any other is refused by name.
"""

from __future__ import annotations

from pathlib import Path

from ringsched.weights.families import UnsupportedModelError
from ringsched.weights.gguf_meta import Meta
from ringsched.weights.tokenizer_build import build_bpe_tokenizer, build_spm_tokenizer, write_tokenizer_files

_TAIL = r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}" + _TAIL  # also cl100k's (DBRX, Phi-4)
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}" + _TAIL
_UPPER, _LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_CASED = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+", rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*")
_O200K_TAIL = r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_GPT4O = "|".join(w + _CONTRACTIONS + "?" for w in _CASED) + r"|\p{N}{1,3}" + _O200K_TAIL  # Phi-4-mini
_TEKKEN = "|".join(_CASED) + r"|\p{N}" + _O200K_TAIL  # Mistral Nemo and later
# `tokenizer.ggml.pre` -> the regex its words are cut by; any other (SmolLM's, GPT-2's) takes GPT-2's own
SPLITS = {
    "llama-bpe": _LLAMA3,
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "smaug-bpe": _LLAMA3,
    "dbrx": _LLAMA3,
    "qwen2": _QWEN2,
    "deepseek-r1-qwen": _QWEN2,
    "gpt-4o": _GPT4O,
    "tekken": _TEKKEN,
}
# Control tokens that end a turn, which llama.cpp stops at whatever the file's eos: Llama 3's, ChatML's, Phi-3's,
# Gemma's. `<|endoftext|>` is not among them: in ChatML vocabularies it separates documents, not turns.
END_OF_TURN = frozenset({"<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|im_end|>", "<|end|>", "<end_of_turn>"})
_CONTROL, _USER_DEFINED = 3, 4


def write_gguf_tokenizer(meta: Meta, out_dir: Path, max_len: int) -> None:
    """The tokenizer files for the file `meta` reads; `UnsupportedModelError` naming another tokenizer model."""
    model = meta.get("tokenizer.ggml.model")
    tokens = list(meta.get("tokenizer.ggml.tokens") or [])
    types = [int(t) for t in meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)]
    merges = list(meta.get("tokenizer.ggml.merges") or [])
    if model == "gpt2":
        tok = build_bpe_tokenizer(tokens, merges, types, split=SPLITS.get(meta.get("tokenizer.ggml.pre")))
    elif model == "llama":
        scores = [float(s) for s in meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)]
        prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))  # llama.cpp's default for SentencePiece
        unk = meta.get("tokenizer.ggml.unknown_token_id")
        tok = build_spm_tokenizer(tokens, scores, types, unk, prefix, merges or None)
    else:
        raise UnsupportedModelError(
            f"GGUF tokenizer model {model!r} is not supported; ringsched builds 'gpt2' "
            "(byte-level BPE) and 'llama' (SentencePiece BPE) tokenizers"
        )
    write_tokenizer_files(
        out_dir,
        tok,
        tokens,
        bos_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_id=meta.get("tokenizer.ggml.eos_token_id"),
        pad_id=meta.get("tokenizer.ggml.padding_token_id"),
        unk_id=meta.get("tokenizer.ggml.unknown_token_id"),
        chat_template=meta.get("tokenizer.chat_template"),
        max_len=max_len,
        # llama.cpp starts a SentencePiece model's prompts with BOS unless the file says not to
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", model == "llama")),
    )


def stop_ids(meta: Meta) -> list[int]:
    """The ids that end a generation: the file's eos, its end-of-turn (`eot`) and end-of-message (`eom`) ids, and
    its control tokens of `END_OF_TURN`."""
    ids = {meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")} - {None}
    tokens = meta.get("tokenizer.ggml.tokens") or []
    types = meta.get("tokenizer.ggml.token_type") or []
    ids.update(
        i
        for i, (t, k) in enumerate(zip(tokens, types, strict=False))
        if k in (_CONTROL, _USER_DEFINED) and t in END_OF_TURN
    )
    return sorted(int(i) for i in ids)
