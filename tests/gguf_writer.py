"""Tiny GGUF files written as llama.cpp's converter writes them (tensor names from gguf-py's own table, Q and K
permuted for `llama`, Gemma's norms plus 1, experts stacked per projection, Phi-3's longrope factors and Llama 3.1's
RoPE divisors as tensors, tokenizer metadata), for `tests/test_gguf_families.py`; quantized by `gguf_quant` where
a caller picks the types (`tests/test_gguf_kept.py`)."""


import dataclasses
import math
import re
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf_quant import quantize
from tokenizers.pre_tokenizers import ByteLevel

from ringsched.models.random_model import CHAT_TEMPLATE, SPECIALS

WINDOW = 8
IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64, "rope_theta": 10000.0}  # fmt: skip
PHI3_ROPE = {"type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(8)],
             "long_factor": [2.0 + 0.5 * i for i in range(8)]}  # fmt: skip
GEMMA3_ROPE = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
               "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Case:
    arch: str  # general.architecture
    hf: str  # transformers' class names, less "Config" / "ForCausalLM" (and the config's, where it differs)
    fields: dict
    meta: dict = dataclasses.field(default_factory=dict)  # `<arch>.*` keys llama.cpp writes beyond the shared ones
    vocab: str = "gpt2"


CASES = {
    "llama": Case("llama", "Llama", dict(head_dim=16, tie_word_embeddings=True)),
    "llama31": Case("llama", "Llama", dict(head_dim=16, max_position_embeddings=512, rope_scaling=LLAMA3)),
    "mistral": Case("llama", "Mistral", dict(head_dim=16, sliding_window=WINDOW), {"attention.sliding_window": WINDOW}),
    "mixtral": Case(
        "llama",
        "Mixtral",
        dict(head_dim=16, num_local_experts=4, num_experts_per_tok=2),
        {"expert_count": 4, "expert_used_count": 2},
    ),
    "qwen2": Case("qwen2", "Qwen2", {}),
    "qwen3": Case("qwen3", "Qwen3", dict(head_dim=16)),
    "qwen3moe": Case(
        "qwen3moe",
        "Qwen3Moe",
        dict(head_dim=16, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, moe_intermediate_size=48),
        {"expert_count": 4, "expert_used_count": 2, "expert_feed_forward_length": 48},
    ),
    "gemma2": Case(
        "gemma2",
        "Gemma2",
        dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW, **IDS),
        {"attention.sliding_window": WINDOW, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
    ),
    "gemma3": Case(
        "gemma3",
        "Gemma3/Gemma3Text",
        dict(
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=WINDOW,
            num_hidden_layers=6,
            rope_parameters=GEMMA3_ROPE,
            **IDS,
        ),
        {"attention.sliding_window": WINDOW, "rope.scaling.type": "linear", "rope.scaling.factor": 8.0},
        vocab="spm",
    ),
    "phi3": Case(
        "phi3",
        "Phi3",
        dict(max_position_embeddings=256, original_max_position_embeddings=64, rope_scaling=PHI3_ROPE, **IDS),
        {"rope.scaling.original_context_length": 64},
        vocab="spm",
    ),
}


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute`: each head's rows from (2, d/2) to (d/2, 2) interleaved."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_divisors(rope: dict, dim: int) -> list[float]:
    """The `rope_freqs` tensor llama.cpp's converter writes for Llama 3.1's RoPE: each frequency's divisor."""
    old, low, high, factor = (rope[k] for k in ("original_max_position_embeddings", "low_freq_factor",
                                                "high_freq_factor", "factor"))  # fmt: skip
    out = []
    for freq in 1.0 / (rope["rope_theta"] ** (np.arange(0, dim, 2) / dim)):
        wavelen = 2 * math.pi / freq
        smooth = (old / wavelen - low) / (high - low)
        out.append(
            1.0 if wavelen < old / high else factor if wavelen > old / low else 1 / ((1 - smooth) / factor + smooth)
        )
    return out


# ---- vocabularies -----------------------------------------------------------------------------------------------

CORPUS = (
    "the cat sat on the mat and the dog ate the hat then the rat ran at the cat in the hot sun while a "
    "quick brown fox jumps over the lazy dog and some other words make many more pairs to merge here"
)


def gpt2_vocab(size: int) -> dict:
    """Byte-level BPE: the specials (control), the 256 byte symbols, a few merges (some only where a word-splitting
    regex lets them: `'M` for Llama 3's case-blind contractions, `123` where digits are not cut one by one), filler."""
    tokens = SPECIALS + sorted(ByteLevel.alphabet()) + ["Ġt", "he", "Ġthe", "12", "123", "'M"]
    tokens += [f"<x{i}>" for i in range(len(tokens), size)]
    return {"model": "gpt2", "tokens": tokens, "types": [3 if t in SPECIALS else 1 for t in tokens],
            "merges": ["Ġ t", "h e", "Ġt he", "1 2", "12 3", "' M"]}  # fmt: skip


def spm_vocab(size: int, controls: tuple[str, ...] = ("<|end|>", "<|user|>")) -> dict:
    """SentencePiece BPE as llama.cpp stores it: <unk>, <s>, </s>, the byte tokens, the characters of `CORPUS` and
    the merges a small BPE training on it learns (score: minus the rank), control tokens last."""
    text = list("▁" + CORPUS.replace(" ", "▁"))
    pieces = sorted(set(text))
    while len(pieces) < size - 3 - 256 - len(controls):
        pairs = Counter(p for p in zip(text, text[1:], strict=False) if not p[1].startswith("▁"))
        (left, right), _ = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        pieces.append(left + right)
        merged, i = [], 0
        while i < len(text):
            if text[i : i + 2] == [left, right]:
                merged.append(left + right)
                i += 2
            else:
                merged.append(text[i])
                i += 1
        text = merged
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces, *controls]
    types = [2, 3, 3, *[6] * 256, *[1] * len(pieces), *[3] * len(controls)]
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))] + [0.0] * len(controls)
    return {"model": "llama", "tokens": tokens, "types": types, "scores": scores}


def write_vocab(
    w, vocab: dict, bos: int | None, eos: int | None, pre: str = "default", add_space_prefix: bool | None = None
):
    w.add_tokenizer_model(vocab["model"])
    w.add_tokenizer_pre(pre)
    w.add_token_list(vocab["tokens"])
    w.add_token_types(vocab["types"])
    if "merges" in vocab:
        w.add_token_merges(vocab["merges"])
    if "scores" in vocab:
        w.add_token_scores(vocab["scores"])
        w.add_unk_token_id(0)
    if add_space_prefix is not None:
        w.add_add_space_prefix(add_space_prefix)
    if bos is not None:
        w.add_bos_token_id(bos)
    if eos is not None:
        w.add_eos_token_id(eos)
    w.add_chat_template(CHAT_TEMPLATE)


# ---- a model written as llama.cpp's converter writes it -----------------------------------------------------------

_EXPERT = {"w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}


def gguf_tensors(case: Case, config, state: dict[str, torch.Tensor]):
    """(name, array) pairs as llama.cpp names and transforms them."""
    arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == case.arch)
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    experts: dict[tuple[str, str], dict[int, np.ndarray]] = defaultdict(dict)
    for hf_name, t in state.items():
        a = t.float().numpy()
        m = re.fullmatch(r"model\.layers\.(\d+)\.\w+\.experts\.(\d+)\.(\w+)\.weight", hf_name)
        if m:
            experts[(m[1], _EXPERT[m[3]])][int(m[2])] = a
            continue
        if case.arch == "llama" and re.search(r"\.(q|k)_proj\.", hf_name):
            a = permute(a, config.num_attention_heads if ".q_proj." in hf_name else config.num_key_value_heads)
        if case.arch.startswith("gemma") and hf_name.endswith("norm.weight"):
            a = a + 1
        base, suffix = hf_name.rsplit(".", 1)
        assert names.get_name(base), f"llama.cpp has no name for {base} in {case.arch}"
        yield f"{names.get_name(base)}.{suffix}", a
    for (layer, proj), by_expert in experts.items():
        yield f"blk.{layer}.ffn_{proj}_exps.weight", np.stack([by_expert[e] for e in sorted(by_expert)])
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type") == "llama3":
        yield "rope_freqs.weight", np.array(llama3_divisors(rope, config.head_dim), dtype=np.float32)
    if case.arch == "phi3":
        yield "rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32)
        yield "rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32)


def write_gguf(
    path: Path,
    case: Case,
    config,
    state: dict[str, torch.Tensor],
    quant: Callable[[str, np.ndarray], str | None] | None = None,
) -> Path:
    """`quant(gguf_name, array)`: the GGML type to store that tensor as ("Q4_K", "Q8_0", ..., "F16"); None or "F32"
    keeps float32 (as does leaving `quant` out)."""
    w = gguf.GGUFWriter(str(path), case.arch)
    w.add_name(f"tiny {case.hf}")
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    rope = config.rope_parameters.get("full_attention", config.rope_parameters)
    w.add_block_count(config.num_hidden_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_rope_dimension_count(head_dim)
    if case.arch != "phi3":  # as the converter: key_length where the config states head_dim
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if case.arch == "llama":
        w.add_vocab_size(config.vocab_size)
    for key, value in case.meta.items():
        add = w.add_string if isinstance(value, str) else w.add_float32 if isinstance(value, float) else w.add_uint32
        add(f"{case.arch}.{key}", value)
    vocab = spm_vocab(config.vocab_size) if case.vocab == "spm" else gpt2_vocab(config.vocab_size)
    pre = {"llama": "llama-bpe", "qwen2": "qwen2", "qwen3": "qwen2", "qwen3moe": "qwen2"}.get(case.arch, "default")
    write_vocab(
        w, vocab, config.bos_token_id, config.eos_token_id, pre, False if case.arch.startswith("gemma") else None
    )
    for name, a in gguf_tensors(case, config, state):
        qtype = (quant(name, a) if quant else None) or "F32"
        if qtype in ("F32", "F16"):
            w.add_tensor(name, np.ascontiguousarray(a, dtype=np.float32 if qtype == "F32" else np.float16))
        else:  # [..., row_bytes] uint8 blocks: gguf-py works the tensor's shape out from raw_dtype's block size
            w.add_tensor(name, quantize(a, qtype), raw_dtype=gguf.GGMLQuantizationType[qtype])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
