"""Phi-3 and Phi-4 (`Phi3ForCausalLM`), tiny random models made by transformers' own classes: the checkpoint's fused
`qkv_proj` and `gate_up_proj` read as the separate projections (each tensor-parallel rank only its rows), longrope
scaling (`short_factor` below `original_max_position_embeddings`, `long_factor` from it) and a partial rotary (Phi-4-
mini's 0.75) against transformers' rotary embedding, and greedy tokens equal to transformers' at PP=1, PP=2 and TP=2,
with outputs that cross the original length.

Where the two differ by design (`models/rope.py`): a prompt longer than `original_max_position_embeddings`, which
transformers rotates wholly with `long_factor` and ringsched below that length with `short_factor`."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from ringsched.config import EngineConfig
from ringsched.engine import Engine
from ringsched.layout.rank import StageInfo
from ringsched.models.loader import LoadStats, load_stage_model
from ringsched.models.random_model import random_config
from ringsched.models.rope import Rotary
from ringsched.models.tp import TPGroup
from ringsched.sampling.params import SamplingParams
from ringsched.spec import ModelSpec
from ringsched.weights.config_check import check_config
from ringsched.weights.model_config import ModelConfig, UnsupportedModelError
from ringsched.weights.tp_shard import TPShard

transformers = pytest.importorskip("transformers")

ORIGINAL, HEAD_DIM = 64, 16  # original_max_position_embeddings; hidden 64 over 4 heads


def longrope(rotary_dim: int) -> dict:
    half = rotary_dim // 2
    return dict(max_position_embeddings=256, original_max_position_embeddings=ORIGINAL,
                rope_scaling={"type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(half)],
                              "long_factor": [2.0 + 0.5 * i for i in range(half)]})  # fmt: skip


MODELS = {
    "longrope": longrope(HEAD_DIM),  # Phi-3-mini-128k's kind of RoPE
    "partial": {**longrope(12), "partial_rotary_factor": 0.75},  # Phi-4-mini's: longrope on 12 of 16 dimensions
}
# initializer_range 0.2: attention sharp enough that the rotation decides tokens (at the default 0.02 a table of
# short factors only, or no scaling at all, gave transformers' tokens too; at 0.2 neither does, nor whole heads)
FIELDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, architectures=["Phi3ForCausalLM"], initializer_range=0.2)
# Within the original length, and one (50 + 24) whose output crosses it: long_factor from position 64 on.
PROMPTS = [[5, 17, 42, 99, 3, 250, 7, 11, 13, 200, 31, 64], list(range(40, 90))]
NEW = 24


def save_phi3(out, name: str, seed: int = 3):
    from hf_tiny import save_tiny

    return save_tiny(out, transformers.Phi3Config, transformers.Phi3ForCausalLM, seed=seed, **FIELDS, **MODELS[name])


@pytest.fixture(scope="module", params=sorted(MODELS))
def phi3(request, tmp_path_factory):
    """(name, model directory, transformers' model)."""
    model_dir, hf = save_phi3(tmp_path_factory.mktemp(request.param) / "phi3", request.param)
    return request.param, model_dir, hf


def test_the_config_reads_longrope_and_the_partial_rotary(phi3):
    name, model_dir, _ = phi3
    cfg = ModelConfig.from_dir(model_dir)
    scaling = cfg.rope_scaling
    assert cfg.fused_projections and scaling.rope_type == "longrope" and scaling.long_from == ORIGINAL
    assert scaling.factor == 4.0 and scaling.partial_rotary_factor == (0.75 if name == "partial" else 1.0)
    assert len(scaling.short_factor) == len(scaling.long_factor) == (6 if name == "partial" else 8)


def test_rotary_tables_equal_transformers(phi3):
    """Below the original length transformers' short-factor table, from it (each decode call one position) its
    long-factor rows, bit for bit; the rotation of q and k, partial or whole, too."""
    name, model_dir, hf = phi3
    cfg = ModelConfig.from_dir(model_dir)
    ours = Rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    theirs = transformers.models.phi3.modeling_phi3.Phi3RotaryEmbedding(hf.config)
    x = torch.zeros(1, dtype=torch.float32)
    cos, sin = ours.tables(torch.arange(256))
    assert cos.shape[1] == ours.rotary_dim == (12 if name == "partial" else HEAD_DIM)
    hf_cos, hf_sin = theirs(x, torch.arange(ORIGINAL)[None])
    assert torch.equal(cos[:ORIGINAL], hf_cos[0]) and torch.equal(sin[:ORIGINAL], hf_sin[0])
    for p in (ORIGINAL, 100, 255):
        hf_cos, hf_sin = theirs(x, torch.tensor([[p]]))
        assert torch.equal(cos[p], hf_cos[0, 0]) and torch.equal(sin[p], hf_sin[0, 0])
    whole_call, _ = theirs(x, torch.arange(ORIGINAL + 1)[None])  # a call past the original length: all long
    assert not torch.equal(whole_call[0, :ORIGINAL], cos[:ORIGINAL])  # the documented difference for long prompts
    positions = torch.tensor([3, 70, 200])
    q, k = torch.randn(3, 4, HEAD_DIM), torch.randn(3, 2, HEAD_DIM)
    hf_cos, hf_sin = cos[positions][None], sin[positions][None]  # [1, T, rotary_dim]
    want_q, want_k = transformers.models.phi3.modeling_phi3.apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], hf_cos, hf_sin)  # fmt: skip
    got_q, got_k = ours(positions, q, k)
    assert torch.equal(got_q, want_q[0].transpose(0, 1)) and torch.equal(got_k, want_k[0].transpose(0, 1))
    assert ours.partial == (name == "partial")


@pytest.mark.parametrize("rank", [0, 1])
def test_fused_projections_read_as_each_ranks_rows(phi3, rank):
    """Under TP=2 each rank reads only its rows of `qkv_proj` (its q heads, its KV head's k and v) and of
    `gate_up_proj` (its gate and up rows), and nothing of the separate names (which the checkpoint lacks)."""
    _, model_dir, hf = phi3
    cfg = ModelConfig.from_dir(model_dir)
    stats = LoadStats()
    model = load_stage_model(model_dir, StageInfo(0, 1, 0, cfg.num_layers), stats=stats,
                             tp=TPGroup(TPShard(rank, 2), None))  # fmt: skip
    read = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj", "input_layernorm",
            "post_attention_layernorm")  # fmt: skip
    assert {n for n in stats.tensors_read if "layers.0." in n} == {f"model.layers.0.{n}.weight" for n in read}
    d, q, kv, inter = HEAD_DIM, 4 * HEAD_DIM, 2 * HEAD_DIM, cfg.intermediate_size
    qkv = hf.model.layers[1].self_attn.qkv_proj.weight
    gate_up = hf.model.layers[1].mlp.gate_up_proj.weight
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    half, mid = slice(rank * 2 * d, (rank + 1) * 2 * d), slice(rank * d, (rank + 1) * d)  # 2 q heads, 1 KV head
    assert torch.equal(attn.q_proj.weight, qkv[:q][half])
    assert torch.equal(attn.k_proj.weight, qkv[q : q + kv][mid])
    assert torch.equal(attn.v_proj.weight, qkv[q + kv :][mid])
    rows = slice(rank * inter // 2, (rank + 1) * inter // 2)
    assert torch.equal(mlp.gate_proj.weight, gate_up[:inter][rows])
    assert torch.equal(mlp.up_proj.weight, gate_up[inter:][rows])


def test_the_checkpoint_check_expects_the_fused_names(tmp_path):
    model_dir, _ = save_phi3(tmp_path / "phi3", "partial")
    ModelSpec.resolve(EngineConfig(model=str(model_dir)))  # no "unknown tensor" for qkv_proj, none "missing"
    path = model_dir / "model.safetensors"
    state = load_file(str(path))
    state["model.layers.0.self_attn.q_proj.weight"] = torch.ones(2, 2)
    save_file(state, str(path), metadata={"format": "pt"})
    with pytest.raises(UnsupportedModelError, match=r"would not read, e\.g\. model\.layers\.0\.self_attn\.q_proj"):
        ModelSpec.resolve(EngineConfig(model=str(model_dir)))
    del state["model.layers.0.self_attn.q_proj.weight"], state["model.layers.2.mlp.gate_up_proj.weight"]
    save_file(state, str(path), metadata={"format": "pt"})
    with pytest.raises(UnsupportedModelError, match=r"lacks 1 tensor\(s\).*model\.layers\.2\.mlp\.gate_up_proj"):
        ModelSpec.resolve(EngineConfig(model=str(model_dir)))


def test_only_phi3_honours_partial_rotary_factor(tmp_path):
    model_dir, _ = save_phi3(tmp_path / "phi3", "partial")
    check_config(json.loads((model_dir / "config.json").read_text()))
    llama = random_config("llama", 2, 64, 4, 2, 128, 320, tie=True)
    with pytest.raises(UnsupportedModelError, match="config.json: partial_rotary_factor = 0.75"):
        check_config({**llama, "partial_rotary_factor": 0.75})
    nested = {**llama, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}}
    with pytest.raises(UnsupportedModelError, match="partial_rotary_factor = 0.5"):  # as transformers 5 writes it
        ModelConfig.from_dict(nested)


@pytest.mark.parametrize(("change", "message"), [
    ({"short_factor": [1.0] * 7}, r"rope_scaling of type 'longrope': short_factor has 7 entries; .* has 8"),
    ({"long_factor": None}, "rope_scaling of type 'longrope' needs long_factor"),
    ({"type": "su", "original_max_position_embeddings": None}, "type 'su' needs original_max_position_embeddings"),
])  # fmt: skip
def test_a_longrope_config_without_what_it_needs_is_refused_by_name(change, message):
    config = {**random_config("llama", 2, 64, 4, 2, 128, 320, tie=True), **longrope(HEAD_DIM)}
    config["rope_scaling"] = {**config["rope_scaling"], **change}
    if "original_max_position_embeddings" in change:
        del config["original_max_position_embeddings"]
    with pytest.raises(UnsupportedModelError, match=message):
        ModelConfig.from_dict({k: v for k, v in config.items() if v is not None})


@pytest.mark.slow  # several processes per case: the full suite's
@pytest.mark.parametrize(("pp", "tp"), [(1, 1), (2, 1), (1, 2)], ids=["pp1", "pp2", "tp2"])
def test_greedy_tokens_equal_transformers(phi3, pp, tp):
    from test_model_reference import hf_greedy

    _, model_dir, hf = phi3
    want = [hf_greedy(hf, ids, NEW) for ids in PROMPTS]
    assert len(PROMPTS[1]) < ORIGINAL < len(PROMPTS[1]) + NEW
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    with Engine(model=str(model_dir), pp_size=pp, tp_size=tp, kv_cache_memory="8M", threads_per_stage=1,
                log_level="warning") as llm:  # fmt: skip
        assert [o.token_ids for o in llm.generate(PROMPTS, params)] == want
