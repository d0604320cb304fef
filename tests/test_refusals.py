"""The refusal matrix: every pair of features turned on together is refused exactly when `refusals.REFUSALS` names
the pair, with the table's message; every other pair builds. Flags against flags are `EngineConfig`'s refusals,
flags against the model `ModelSpec.resolve`'s (on a tiny random Mistral with sliding layers)."""

from __future__ import annotations

import itertools

import pytest
import torch

from ringsched.config import ConfigError, EngineConfig
from ringsched.models.random_model import random_config, write_random_model
from ringsched.refusals import REFUSALS
from ringsched.spec import ModelSpec

# Each feature as the flags that turn it on (alone, each builds). `pp_size` 2 is every feature's base: the flexible
# cut needs it, and it changes no other refusal.
FEATURES = {
    "--tp-size": {"tp_size": 2},
    "--cp-size": {"cp_size": 2},
    "--pp-flex-layers": {"pp_flex_layers": 2},
    "--enable-prefix-caching": {"enable_prefix_caching": True},
    "--speculative-config": {"speculative_config": '{"method": "ngram", "num_speculative_tokens": 3}'},
    "--pp-async-batch-depth": {"pp_async_batch_depth": 1},
    "--enable-dynamic-chunking": {"enable_dynamic_chunking": True},
    "--quantization": {"quantization": "int8"},
    "--enable-deterministic-inference": {"enable_deterministic_inference": True},
    "--nnodes": {"nnodes": 2, "dist_init_addr": "127.0.0.1:1"},
}
BASE = {"pp_size": 2}


def _named(features: tuple[str, str]) -> str | None:
    """The key of the table's refusal of these two features (either order), or None."""
    return next((k for k, r in REFUSALS.items() if set(r.features) == set(features)), None)


def _refusal(kw: dict) -> str | None:
    try:
        EngineConfig(**kw)
    except ConfigError as e:
        return str(e)
    return None


@pytest.mark.parametrize("name", FEATURES)
def test_each_feature_alone_builds(name):
    assert _refusal({**BASE, **FEATURES[name]}) is None


@pytest.mark.parametrize("a,b", list(itertools.combinations(FEATURES, 2)))
def test_a_pair_is_refused_exactly_when_the_table_names_it(a, b):
    got = _refusal({**BASE, **FEATURES[a], **FEATURES[b]})
    key = _named((a, b))
    if key is None:
        assert got is None, f"{a} with {b} is refused but not named in refusals.REFUSALS: {got}"
    else:
        assert got == REFUSALS[key].message(cp=2, tp=2, pp=2), f"{a} with {b}"


def test_the_flexible_cut_needs_two_stages():
    assert _refusal({"pp_size": 3, "pp_flex_layers": 2}) == REFUSALS["flex+pp"].message(pp=3)


def test_the_flexible_cut_is_refused_on_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert _refusal({**BASE, "device": "cuda"}) is None
    assert _refusal({**BASE, "device": "cuda", "pp_flex_layers": 2}) == REFUSALS["flex+cuda"].message()


@pytest.fixture(scope="module")
def sliding_model(tmp_path_factory):
    cfg = random_config("llama", 8, 64, 4, 2, 128, 300, True)
    cfg.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=8)
    return str(write_random_model(tmp_path_factory.mktemp("sliding") / "m", cfg))


@pytest.mark.parametrize("flags,key", [({"cp_size": 2}, "cp+sliding"), ({"pp_flex_layers": 2}, "flex+sliding")])
def test_the_model_refusals_come_from_the_table(sliding_model, flags, key):
    ModelSpec.resolve(EngineConfig(model=sliding_model, **BASE))  # the model alone runs
    with pytest.raises(ConfigError) as e:
        ModelSpec.resolve(EngineConfig(model=sliding_model, **BASE, **flags))
    assert str(e.value) == REFUSALS[key].message(cp=2, flex=2, arch="MistralForCausalLM")


def test_every_refusal_in_the_table_is_tested_here():
    flag_pairs = {_named(p) for p in itertools.combinations(FEATURES, 2)} - {None}
    assert flag_pairs | {"flex+pp", "flex+cuda", "cp+sliding", "flex+sliding"} == set(REFUSALS)
