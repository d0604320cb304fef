"""ringsched's model against transformers on the same weights."""

import pytest
import torch

from ringsched.comm.messages import BatchPlan, PlanEntry
from ringsched.kv_cache import BlockTable, KVPool
from ringsched.models.attention import ForwardBatch
from ringsched.models.batch import build_forward_batch
from ringsched.models.config import ModelConfig
from ringsched.models.loader import load_stage_model
from ringsched.parallel.rank import StageInfo

pytestmark = pytest.mark.slow  # real model or several processes: the full suite's

transformers = pytest.importorskip("transformers")

RAW = [
    "The quick brown fox jumps over the lazy dog. In Paris,",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Once upon a time, in a kingdom far away,",
    "1, 2, 3, 5, 8, 13,",
]
CHAT = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "List three prime numbers.",
]


def full_model(model_dir):
    cfg = ModelConfig.from_dir(model_dir)
    return load_stage_model(model_dir, StageInfo(0, 1, 0, cfg.num_layers))


@torch.no_grad()
def logits_of(model, ids):
    return model.compute_logits(model(ForwardBatch.no_cache(len(ids)), input_ids=torch.tensor(ids)))


@torch.no_grad()
def greedy(model, ids, n):
    """Greedy through the paged KV cache, one prefill then one decode per token (the engine's code path)."""
    cfg = model.cfg
    blocks = BlockTable(64, 16)
    pool = KVPool(cfg, cfg.num_layers, 64, 16, torch.float32, "cpu")
    out, start, chunk = [], 0, list(ids)
    for _ in range(n):
        blocks.ensure("r", start + len(chunk))
        plan = BatchPlan(slot=0, seq=0, entries=[PlanEntry("r", start, chunk, True)])
        batch, x = build_forward_batch(plan, blocks, torch.device("cpu"))
        nxt = int(model.compute_logits(model(batch, input_ids=x, kv_caches=pool.caches))[-1].argmax())
        out.append(nxt)
        start, chunk = start + len(chunk), [nxt]
    return out


@torch.no_grad()
def hf_greedy(hf, ids, n):
    """transformers' own forward with its KV cache, argmax at each step; EOS does not stop it (a
    continuation of exactly n tokens, without generate()'s logit processors)."""
    out = hf(torch.tensor([ids]), use_cache=True)
    toks = []
    for _ in range(n):
        nxt = int(out.logits[0, -1].argmax())
        toks.append(nxt)
        out = hf(torch.tensor([[nxt]]), past_key_values=out.past_key_values, use_cache=True)
    return toks



def prompt_ids(tok, i):
    if i < len(RAW):
        return tok(RAW[i])["input_ids"]
    msgs = [{"role": "user", "content": CHAT[i - len(RAW)]}]
    return list(
        tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True)[
            "input_ids"
        ]
    )


def test_logits_match_transformers(smollm2_dir, hf_smol):
    hf, tok = hf_smol
    ours = full_model(smollm2_dir)
    for i in range(len(RAW) + len(CHAT)):
        ids = prompt_ids(tok, i)
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0]
        diff = (logits_of(ours, ids) - ref).abs().max().item()
        assert diff < 1e-3, (i, diff)


@pytest.fixture(scope="module")
def smol(smollm2_dir):
    return full_model(smollm2_dir)


@pytest.mark.parametrize("i", range(8))
def test_greedy_64_tokens_match_transformers(smol, hf_smol, i):
    hf, tok = hf_smol
    ours = smol
    ids = prompt_ids(tok, i)
    assert greedy(ours, ids, 64) == hf_greedy(hf, ids, 64)


def _hf_tiny(kind, tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
    )
    cfg = {
        "llama": lambda: LlamaConfig(**common, tie_word_embeddings=False),
        "qwen2": lambda: Qwen2Config(**common, tie_word_embeddings=True),
        "qwen3": lambda: Qwen3Config(**common, head_dim=32, tie_word_embeddings=False),
    }[kind]()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # transformers initialises biases and norms to constants: make them matter
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(tmp_path)
    return model


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_tiny_transformers_models(kind, tmp_path):
    hf = _hf_tiny(kind, tmp_path)
    ours = full_model(tmp_path)
    ids = [5, 17, 42, 99, 3, 250, 7, 8, 19, 200]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert (logits_of(ours, ids) - ref).abs().max().item() < 1e-4
    assert greedy(ours, ids, 32) == hf_greedy(hf, ids, 32)


def test_unsupported_architecture_is_refused():
    from ringsched.models.config import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match="LlamaForCausalLM"):
        ModelConfig.from_dict(
            {
                "architectures": ["GPT2LMHeadModel"],
                "num_hidden_layers": 2,
                "hidden_size": 8,
                "intermediate_size": 8,
                "num_attention_heads": 2,
                "vocab_size": 10,
            }
        )
