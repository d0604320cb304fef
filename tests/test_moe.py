"""Mixtures of experts (`models/moe.py`): the batched expert path against a per-token loop and against
transformers' own blocks, the tensor-parallel shards summing to the whole, the loader refusing a checkpoint short
of an expert, the layer pricing; and (slow) tiny random Mixtral and Qwen3-MoE made by transformers' classes
generating transformers' greedy tokens at PP=1, PP=2, TP=2 and TP=2 x PP=2."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from hf_tiny import save_tiny
from safetensors.torch import load_file, save_file

from ringsched.config import EngineConfig
from ringsched.layout.partition import HEAD_SHARE, head_layers
from ringsched.models.moe import SparseMoE
from ringsched.models.parallel_linear import read_slices
from ringsched.models.tp import SoloGroup, TPGroup
from ringsched.spec import ModelSpec
from ringsched.weights.model_config import ModelConfig, UnsupportedModelError, layer_matmul_params, layer_weight_params
from ringsched.weights.tp_shard import TPLayoutError, TPShard, check_tp

transformers = pytest.importorskip("transformers")

SIZES = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2)  # fmt: skip
# Qwen3-MoE with an expert width that splits unevenly over two ranks (22 + 23) and a dense layer (1) among the sparse
QWEN = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=45, mlp_only_layers=[1])
MIXTRAL = dict(num_local_experts=4, num_experts_per_tok=2)
FAMILIES = {
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM, "MixtralForCausalLM", MIXTRAL),
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM, "Qwen3MoeForCausalLM", QWEN),
}


def model_config(family: str, **fields) -> ModelConfig:
    config_class, _, arch, moe = FAMILIES[family]
    return ModelConfig.from_dict({**config_class(**SIZES, **moe, **fields).to_dict(), "architectures": [arch]})


def random_moe(cfg: ModelConfig, group: TPGroup | None = None, seed: int = 0) -> SparseMoE:
    torch.manual_seed(seed)
    moe = SparseMoE(cfg, group)
    with torch.no_grad():
        for name, p in moe.named_parameters():
            p.normal_(0, 0.5 if name == "gate.weight" else 0.1)  # a decisive router; experts that count
    return moe


def per_token(moe: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """The mixture one token and one expert at a time, as its definition reads."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = torch.softmax(x[t] @ moe.gate.weight.T, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, moe.top_k)
        if moe.norm_topk_prob:
            weights = weights / weights.sum()
        for w, e in zip(weights.tolist(), ids.tolist(), strict=True):
            ex, row = moe.experts[e], x[t : t + 1]
            out[t] += w * ex.down.partial_sum(F.silu(ex.gate(row)) * ex.up(row))[0]
    return out


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("rows", [1, 37])
@pytest.mark.parametrize("norm", [True, False])
def test_the_batched_experts_equal_a_per_token_loop(family, rows, norm):
    cfg = model_config(family, **({"norm_topk_prob": norm} if family == "qwen3_moe" else {}))
    moe = random_moe(cfg)
    moe.prepare_linears("none")
    x = torch.randn(rows, cfg.hidden_size)
    torch.testing.assert_close(moe(x.clone()), per_token(moe, x), rtol=1e-5, atol=1e-5)


def _hf_block(family: str, cfg: ModelConfig, moe: SparseMoE, norm: bool):
    """transformers' sparse block of the family, holding `moe`'s weights (its experts as 3-D tensors)."""
    config_class, _, _, fields = FAMILIES[family]
    hf_cfg = config_class(**SIZES, **fields, **({"norm_topk_prob": norm} if family == "qwen3_moe" else {}))
    module = transformers.models.mixtral.modeling_mixtral if family == "mixtral" else \
        transformers.models.qwen3_moe.modeling_qwen3_moe  # fmt: skip
    block = (module.MixtralSparseMoeBlock if family == "mixtral" else module.Qwen3MoeSparseMoeBlock)(hf_cfg).eval()
    with torch.no_grad():
        block.gate.weight.copy_(moe.gate.weight)
        block.experts.gate_up_proj.copy_(torch.stack([torch.cat([e.gate.weight, e.up.weight]) for e in moe.experts]))
        block.experts.down_proj.copy_(torch.stack([e.down.weight for e in moe.experts]))
    return block


@pytest.mark.parametrize(("family", "norm"), [("mixtral", True), ("qwen3_moe", False), ("qwen3_moe", True)])
def test_the_mixture_matches_transformers_block(family, norm):
    cfg = model_config(family, **({"norm_topk_prob": norm} if family == "qwen3_moe" else {}))
    moe = random_moe(cfg, seed=3)
    block = _hf_block(family, cfg, moe, norm)
    moe.prepare_linears("none")
    x = torch.randn(29, cfg.hidden_size)
    with torch.no_grad():
        want = block(x[None])[0]
    torch.testing.assert_close(moe(x.clone()), want, rtol=1e-5, atol=1e-5)


class HalfGroup(SoloGroup):
    """Rank `rank` of two, its all-reduce left to the test (it returns the rank's partial sum)."""

    def __init__(self, rank: int) -> None:
        TPGroup.__init__(self, TPShard(rank, 2), None)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_two_ranks_slices_of_every_expert_sum_to_the_whole(family):
    cfg = model_config(family)
    whole = random_moe(cfg)
    state = whole.state_dict()
    whole.prepare_linears("none")
    x = torch.randn(23, cfg.hidden_size)
    parts = []
    for rank in range(2):
        shard = SparseMoE(cfg, HalfGroup(rank))
        cuts = read_slices(shard)
        assert cuts["experts.0." + cfg.moe.names[3] + ".weight"][0] == 1  # down row-parallel: its columns
        assert "gate.weight" not in cuts  # the router is whole on every rank
        own = {}
        for name, t in state.items():
            dim, start, stop = cuts.get(name, (0, 0, t.shape[0]))
            own[name] = t.narrow(dim, start, stop - start)
        shard.load_state_dict(own)
        shard.prepare_linears("none")
        parts.append(shard(x.clone()))
    torch.testing.assert_close(parts[0] + parts[1], whole(x.clone()), rtol=1e-5, atol=1e-5)


def test_int8_experts_stay_close_to_float():
    cfg = model_config("mixtral")
    exact, quantised = random_moe(cfg), random_moe(cfg)
    exact.prepare_linears("none")
    quantised.prepare_linears("int8")
    assert quantised.experts[0].gate_up.weight.dtype == torch.int8 and quantised.gate.weight.dtype == torch.float32
    x = torch.randn(9, cfg.hidden_size)
    want = exact(x.clone())
    assert (quantised(x.clone()) - want).norm() < 0.02 * want.norm()


def test_tp_wider_than_the_experts_is_refused():
    cfg = model_config("qwen3_moe")
    check_tp(cfg, 2)
    narrow = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, intermediate=1))
    with pytest.raises(TPLayoutError, match="experts' width 1 is narrower than 2 ranks"):
        check_tp(narrow, 2)


def test_a_layer_is_priced_by_the_experts_a_token_takes():
    cfg = model_config("qwen3_moe")
    h, attn = cfg.hidden_size, 2 * 64 * 64 + 2 * 64 * 32
    assert cfg.moe.layers == (0, 2, 3)
    assert layer_matmul_params(cfg, 0) == attn + h * (4 + 3 * 2 * 45)  # the router, two experts
    assert layer_weight_params(cfg, 0) == attn + h * (4 + 3 * 4 * 45)  # every expert
    assert layer_matmul_params(cfg, 1) == layer_weight_params(cfg, 1) == attn + 3 * h * 128  # the dense layer
    mean = sum(layer_matmul_params(cfg, i) for i in range(4)) / 4
    assert head_layers(cfg) == pytest.approx(HEAD_SHARE * cfg.vocab_size * h / mean)


def _hf_model(out, family: str, seed: int = 0):
    """A tiny random model of `family` saved to `out` by transformers, its router and experts drawn larger than
    transformers' init (a decisive router; experts whose output counts against the residual); the model returned
    runs its experts eagerly, one at a time, as `modeling_mixtral.MixtralExperts` reads."""
    config_class, model_class, _, fields = FAMILIES[family]
    out, hf = save_tiny(out, config_class, model_class, seed=seed, **fields)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if ".mlp.gate.weight" in name or ".mlp.experts." in name:
                p.normal_(0, 0.5 if "gate.weight" in name else 0.1)
    hf.save_pretrained(str(out))
    hf.set_experts_implementation("eager")  # the per-expert loop (grouped_mm wants widths of 16-byte multiples)
    return out, hf


def test_a_checkpoint_short_of_an_expert_is_refused(tmp_path):
    model_dir, _ = _hf_model(tmp_path / "mixtral", "mixtral")
    ModelSpec.resolve(EngineConfig(model=str(model_dir)))
    path = model_dir / "model.safetensors"
    state = load_file(str(path))
    state.pop("model.layers.2.block_sparse_moe.experts.3.w3.weight")
    save_file(state, str(path), metadata={"format": "pt"})
    lacks = r"lacks 1 tensor\(s\).*layers\.2\.block_sparse_moe\.experts\.3\.w3"
    with pytest.raises(UnsupportedModelError, match=lacks):
        ModelSpec.resolve(EngineConfig(model=str(model_dir)))


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    made = {}

    def get(family: str):
        if family not in made:
            made[family] = _hf_model(tmp_path_factory.mktemp(family) / family, family, seed=7)
        return made[family]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize(("pp", "tp"), [(1, 1), (2, 1), (1, 2), (2, 2)], ids=["pp1", "pp2", "tp2", "tp2pp2"])
def test_a_mixture_of_experts_matches_transformers(tiny_moe, family, pp, tp):
    from test_model_reference import hf_greedy

    from ringsched.engine import Engine
    from ringsched.sampling.params import SamplingParams

    model_dir, hf = tiny_moe(family)
    prompts = [list(range(40, 90)), torch.randint(3, 320, (47,), generator=torch.Generator().manual_seed(1)).tolist()]
    want = [hf_greedy(hf, ids, 24) for ids in prompts]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    with Engine(model=str(model_dir), pp_size=pp, tp_size=tp, kv_cache_memory="8M", threads_per_stage=1,
                log_level="warning") as llm:  # fmt: skip
        assert [o.token_ids for o in llm.generate(prompts, params)] == want
