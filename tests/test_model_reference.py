"""ringsched's model against transformers on the same weights."""

import pytest
import torch

from ringsched.attention.batch import build_forward_batch
from ringsched.attention.paged import ForwardBatch
from ringsched.comm.messages import BatchPlan, PlanEntry
from ringsched.kv.cache import BlockTable, KVPool
from ringsched.layout.rank import StageInfo
from ringsched.models.loader import load_stage_model
from ringsched.weights.model_config import ModelConfig

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


def test_logits_match_transformers(smol, hf_smol):
    hf, tok = hf_smol
    ours = smol
    for i in range(len(RAW) + len(CHAT)):
        ids = prompt_ids(tok, i)
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0]
        diff = (logits_of(ours, ids) - ref).abs().max().item()
        assert diff < 1e-3, (i, diff)


@pytest.fixture(scope="module")
def smol(smollm2_dir):
    return full_model(smollm2_dir)


GREEDY_TOKENS = 32  # a continuation past two 16-token KV blocks beyond each prompt's own


@pytest.fixture(scope="module")
def hf_tokens(hf_smol):
    """`get(i)`: prompt i's ids and transformers' greedy tokens after it, computed once for the module."""
    hf, tok = hf_smol
    got: dict[int, tuple[list[int], list[int]]] = {}

    def get(i: int) -> tuple[list[int], list[int]]:
        if i not in got:
            ids = prompt_ids(tok, i)
            got[i] = ids, hf_greedy(hf, ids, GREEDY_TOKENS)
        return got[i]

    return get


@pytest.mark.parametrize("i", [2, 3, 6, 7])  # the others go on each path below
def test_greedy_tokens_match_transformers(smol, hf_tokens, i):
    ids, want = hf_tokens(i)
    assert greedy(smol, ids, GREEDY_TOKENS) == want


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


ROPE = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "yarn-mscale": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32, "mscale": 0.707,
                    "mscale_all_dim": 0.707, "beta_fast": 16, "beta_slow": 2},
}  # fmt: skip


@pytest.mark.parametrize("written_as", ["rope_parameters", "rope_scaling"])
@pytest.mark.parametrize("kind", list(ROPE))
def test_rope_scaling_matches_transformers(kind, written_as, tmp_path):
    """A tiny Llama with each RoPE scaling, its config written the transformers-5 way (`rope_parameters` with the
    theta inside) or the older way (`rope_scaling` beside `rope_theta`)."""
    import json

    from transformers import AutoModelForCausalLM, LlamaConfig

    params = {"rope_theta": 10000.0, **ROPE[kind]}
    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, rope_parameters=params)  # fmt: skip
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    hf.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    written = json.loads(path.read_text())
    assert written["rope_parameters"]["rope_type"] == ROPE[kind]["rope_type"]
    if written_as == "rope_scaling":
        scaling = dict(written.pop("rope_parameters"))
        written["rope_theta"] = scaling.pop("rope_theta")
        scaling["type"] = scaling.pop("rope_type")  # the oldest spelling
        written["rope_scaling"] = scaling
    path.write_text(json.dumps(written))
    ours = full_model(tmp_path)
    assert ours.cfg.rope_scaling.rope_type == ROPE[kind]["rope_type"]
    ids = [(17 * i + 5) % 300 for i in range(120)]  # past every original context above
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert (logits_of(ours, ids) - ref).abs().max().item() < 1e-4
    plain = LlamaConfig(**{**cfg.to_dict(), "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}})
    if kind != "dynamic":  # the scaling changes the logits (dynamic, within the context, does not)
        torch.manual_seed(0)
        unscaled = AutoModelForCausalLM.from_config(plain, dtype=torch.float32).eval()
        with torch.no_grad():
            assert (unscaled(torch.tensor([ids])).logits[0] - ref).abs().max().item() > 1e-3


@pytest.mark.parametrize(
    "change, message",
    [
        ({"rope_scaling": {"rope_type": "dynamic_ntk", "factor": 2.0}}, "rope_scaling of type 'dynamic_ntk'"),
        ({"rope_parameters": {"rope_type": "su", "rope_theta": 1.0}}, "needs"),
        ({"rope_scaling": {"rope_type": "linear"}}, "needs a factor"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"architectures": ["GPT2LMHeadModel"]}, "architecture 'GPT2LMHeadModel' is not supported"),
    ],
)
def test_what_the_model_code_does_not_run_is_refused_by_name(change, message):
    from ringsched.models.random_model import random_config
    from ringsched.weights.model_config import UnsupportedModelError

    cfg = {**random_config("llama", 2, 64, 4, 2, 96, 300, tie=True), **change}
    with pytest.raises(UnsupportedModelError, match=message):
        ModelConfig.from_dict(cfg)


def test_unsupported_architecture_is_refused():
    from ringsched.weights.model_config import UnsupportedModelError

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


@pytest.fixture(scope="module", params=["native", "torch"])
def smol_one_path(smollm2_dir, request):
    """SmolLM2 with every linear call on one path at every row count: the two extremes `--linear-tuning auto`
    can choose between in float32 (the tests otherwise run the fixed thresholds, `tests/conftest.py`)."""
    from ringsched.kernels import small_linear
    from ringsched.kernels.linear_tuning import BUCKETS, PathTable

    if request.param == small_linear.NATIVE and small_linear.library() is None:
        pytest.skip("no C compiler: no kernel")
    model = full_model(smollm2_dir)
    for lin in model.linears():
        lin.paths = PathTable(BUCKETS, (request.param,) * len(BUCKETS))
    model.paths_chosen()
    return model


@pytest.mark.parametrize("i", [0, 1, 4, 5])
def test_greedy_tokens_match_transformers_whichever_path_tuning_takes(smol_one_path, hf_tokens, i):
    ids, want = hf_tokens(i)
    assert greedy(smol_one_path, ids, GREEDY_TOKENS) == want
