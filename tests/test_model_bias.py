"""Biases as each family places them: a Llama with `attention_bias` (q, k, v and o) and `mlp_bias` (gate, up,
down), against transformers on the same weights, at PP=1, PP=2 and TP=2 (a row-parallel bias is added once over
the ranks: the first rank's)."""

from __future__ import annotations

import pytest
import torch

from ringsched.engine import Engine
from ringsched.models.random_model import random_config, write_random_model
from ringsched.sampling.params import SamplingParams
from ringsched.weights.model_config import ModelConfig

pytestmark = pytest.mark.slow  # several processes per case: the full suite's

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def biased_llama(tmp_path_factory):
    config = {**random_config("llama", 4, 64, 4, 2, 128, 320, tie=False), "attention_bias": True, "mlp_bias": True}
    model_dir = write_random_model(tmp_path_factory.mktemp("biased") / "llama", config, seed=5)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():  # every bias of the checkpoint is in transformers' model, none left at its init
        named = dict(hf.named_parameters())
        for layer in ("q_proj", "k_proj", "v_proj", "o_proj"):
            assert named[f"model.layers.0.self_attn.{layer}.bias"].abs().sum() > 0
        for layer in ("gate_proj", "up_proj", "down_proj"):
            assert named[f"model.layers.0.mlp.{layer}.bias"].abs().sum() > 0
    return model_dir, hf


def test_config_reads_the_biases(biased_llama):
    cfg = ModelConfig.from_dir(biased_llama[0])
    assert cfg.attention_bias and cfg.o_proj_bias and cfg.mlp_bias


@pytest.mark.parametrize(("pp", "tp"), [(1, 1), (2, 1), (1, 2)], ids=["pp1", "pp2", "tp2"])
def test_a_biased_llama_matches_transformers(biased_llama, pp, tp):
    from test_model_reference import hf_greedy

    model_dir, hf = biased_llama
    prompts = [[5, 17, 42, 99, 3, 250, 7], list(range(40, 90))]
    want = [hf_greedy(hf, ids, 24) for ids in prompts]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    with Engine(model=str(model_dir), pp_size=pp, tp_size=tp, kv_cache_memory="8M", threads_per_stage=1,
                log_level="warning") as llm:  # fmt: skip
        assert [o.token_ids for o in llm.generate(prompts, params)] == want
