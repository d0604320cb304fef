"""Gemma 2, Gemma 3 and sliding-window Mistral and Qwen2, each a tiny random model made by transformers' own classes:
ringsched's greedy tokens equal transformers' at PP=1, PP=2 and TP=2 on prompts longer than the sliding window, in
chunks, with prompt and outputs long enough that each request's ring of sliding KV (`kv/ring.py`: 2 blocks of 16 for
a window of 8 and chunks of 8) wraps several times; and the window matters (the same weights attending to everything
give other tokens)."""

from __future__ import annotations

import json

import pytest
import torch

from ringsched.config import ConfigError, EngineConfig
from ringsched.engine import Engine
from ringsched.sampling.params import SamplingParams
from ringsched.spec import ModelSpec
from ringsched.weights.model_config import ModelConfig

pytestmark = pytest.mark.slow  # transformers' models and several processes per case: the full suite's

transformers = pytest.importorskip("transformers")

WINDOW = 8
GEMMA = dict(head_dim=16, sliding_window=WINDOW, pad_token_id=0, eos_token_id=1, bos_token_id=2)
FAMILIES = {
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", GEMMA),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {
        **GEMMA, "sliding_window_pattern": 2, "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": WINDOW}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": WINDOW,
                                                  "max_window_layers": 2}),
}  # fmt: skip
PROMPTS = [[5, 17, 42, 99, 3, 250, 7, 11, 13, 200, 31, 64], list(range(40, 100))]  # both past the window
NEW = 40
CHUNK = 8  # --chunked-prefill-size: the 60-token prompt in 8 chunks


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    from hf_tiny import save_tiny
    from test_model_reference import hf_greedy

    config_class, model_class, fields = FAMILIES[request.param]
    out = tmp_path_factory.mktemp(request.param)
    model_dir, hf = save_tiny(out, getattr(transformers, config_class), getattr(transformers, model_class), **fields)
    return request.param, model_dir, [hf_greedy(hf, ids, NEW) for ids in PROMPTS]


def test_the_config_reads_the_layer_kinds(family):
    name, model_dir, _ = family
    cfg = ModelConfig.from_dir(model_dir)
    assert cfg.sliding_window == WINDOW and "sliding" in cfg.layer_types
    if name.startswith("gemma"):
        assert cfg.family == "gemma" and cfg.hidden_act == "gelu_pytorch_tanh" and cfg.embed_scale == 8.0
    if name == "gemma2":
        assert cfg.attn_softcap == 50.0 and cfg.final_softcap == 30.0 and cfg.layer_types[:2] == ("sliding", "full")
    if name == "gemma3":
        assert cfg.qk_norm and cfg.local_rope[0] == 1e4 and cfg.rope_scaling.rope_type == "linear"


@pytest.mark.parametrize(("pp", "tp"), [(1, 1), (2, 1), (1, 2)], ids=["pp1", "pp2", "tp2"])
def test_greedy_tokens_equal_transformers(family, pp, tp):
    _, model_dir, want = family
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    with Engine(model=str(model_dir), pp_size=pp, tp_size=tp, kv_cache_memory="8M", threads_per_stage=1,
                chunked_prefill_size=CHUNK, log_level="warning") as llm:  # fmt: skip
        assert [o.token_ids for o in llm.generate(PROMPTS, params)] == want


def test_prefix_caching_asked_for_gives_the_same_tokens(family):
    """--enable-prefix-caching with sliding layers: turned off (a cached prefix has no KV in the rings), the same
    tokens for a prompt repeated."""
    _, model_dir, want = family
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    with Engine(model=str(model_dir), kv_cache_memory="8M", threads_per_stage=1, chunked_prefill_size=CHUNK,
                enable_prefix_caching=True, log_level="warning") as llm:  # fmt: skip
        first = [o.token_ids for o in llm.generate(PROMPTS, params)]
        again = [o.token_ids for o in llm.generate(PROMPTS[1:], params)]
    assert first == want and again == want[1:]


def test_the_window_matters(family, tmp_path):
    """The same weights with every layer attending to all its context: other tokens (so the tests above would
    catch a window ignored)."""
    from test_model_reference import greedy

    from ringsched.layout.rank import StageInfo
    from ringsched.models.loader import load_stage_model

    name, model_dir, want = family
    config = json.loads((model_dir / "config.json").read_text())
    config.update(layer_types=["full_attention"] * config["num_hidden_layers"], sliding_window=None,
                  use_sliding_window=False)  # fmt: skip
    for f in model_dir.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "config.json").write_text(json.dumps(config))
    full = load_stage_model(tmp_path, StageInfo(0, 1, 0, config["num_hidden_layers"]))
    windowed = load_stage_model(model_dir, StageInfo(0, 1, 0, config["num_hidden_layers"]))
    ids = PROMPTS[1]
    with torch.no_grad():
        assert greedy(windowed, ids, NEW) == want[1]
        assert greedy(full, ids, NEW) != want[1]


def test_context_parallelism_is_refused_for_sliding_layers(family):
    _, model_dir, _ = family
    with pytest.raises(ConfigError, match="--cp-size 2: context parallelism runs full attention"):
        ModelSpec.resolve(EngineConfig(model=str(model_dir), cp_size=2))


def test_a_flexible_cut_is_refused_for_sliding_layers(family):
    _, model_dir, _ = family
    with pytest.raises(ConfigError, match="--pp-flex-layers 1: a moving cut mirrors"):
        ModelSpec.resolve(EngineConfig(model=str(model_dir), pp_size=2, pp_flex_layers=1))
