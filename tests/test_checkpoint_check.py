"""Checkpoints ringsched would load silently wrong are refused before any stage starts, naming the field or the
tensor: a `quantization_config`, each config field of `UNSUPPORTED_FIELDS`, FP8 scales or other tensors the model
would not read, a tensor it needs that is missing."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from ringsched.config import EngineConfig
from ringsched.models.random_model import random_config, write_random_model
from ringsched.spec import ModelSpec
from ringsched.weights.config_check import UNSUPPORTED_FIELDS, check_config
from ringsched.weights.model_config import UnsupportedModelError

REFUSED = {
    "use_sliding_window": True, "layer_types": ["sliding_attention", "full_attention"],
    "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "partial_rotary_factor": 0.5,
    "num_local_experts": 8, "num_experts": 128,
}  # fmt: skip
ACCEPTED = {
    "use_sliding_window": False, "layer_types": ["full_attention", "full_attention"], "attn_logit_softcapping": None,
    "final_logit_softcapping": None, "partial_rotary_factor": 1.0, "num_local_experts": 0, "num_experts": None,
}  # fmt: skip


def test_every_listed_field_has_a_refused_and_an_accepted_value():
    assert set(REFUSED) == set(UNSUPPORTED_FIELDS) == set(ACCEPTED)


@pytest.mark.parametrize("field", sorted(UNSUPPORTED_FIELDS))
def test_a_field_that_changes_the_computation_is_refused_by_name(field):
    base = random_config("llama", 2, 64, 4, 2, 128, 320, tie=True)
    with pytest.raises(UnsupportedModelError, match=f"config.json: {field} = "):
        check_config({**base, field: REFUSED[field]})
    check_config({**base, field: ACCEPTED[field]})


def test_a_quantization_config_is_refused_naming_its_method():
    base = random_config("llama", 2, 64, 4, 2, 128, 320, tie=True)
    with pytest.raises(UnsupportedModelError, match=r"quantization_config \(quant_method 'fp8'\)"):
        check_config({**base, "quantization_config": {"quant_method": "fp8", "fmt": "e4m3"}})


@pytest.fixture
def tiny(tmp_path):
    return write_random_model(tmp_path / "tiny", random_config("llama", 2, 64, 4, 2, 128, 320, tie=True))


def _edit(model_dir, change) -> None:
    path = model_dir / "model.safetensors"
    state = load_file(str(path))
    change(state)
    save_file(state, str(path), metadata={"format": "pt"})


def test_fp8_scales_are_refused_naming_the_tensor(tiny):
    _edit(tiny, lambda s: s.update({"model.layers.0.self_attn.q_proj.weight_scale": torch.ones(1)}))
    with pytest.raises(UnsupportedModelError, match=r"q_proj\.weight_scale.*FP8"):
        ModelSpec.resolve(EngineConfig(model=str(tiny)))


def test_unknown_and_missing_tensors_are_refused(tiny):
    _edit(tiny, lambda s: s.update({"model.layers.0.mlp.experts.0.w1.weight": torch.ones(2, 2)}))
    unread = r"1 tensor\(s\) .* not read, e\.g\. model\.layers\.0\.mlp\.experts"
    with pytest.raises(UnsupportedModelError, match=unread):
        ModelSpec.resolve(EngineConfig(model=str(tiny)))
    drop = ("model.layers.0.mlp.experts.0.w1.weight", "model.layers.1.mlp.up_proj.weight")
    _edit(tiny, lambda s: [s.pop(name) for name in drop])
    with pytest.raises(UnsupportedModelError, match=r"lacks 1 tensor\(s\).*model\.layers\.1\.mlp\.up_proj\.weight"):
        ModelSpec.resolve(EngineConfig(model=str(tiny)))


def test_the_launcher_refuses_a_quantized_checkpoint_before_any_stage(tiny):
    config = json.loads((tiny / "config.json").read_text())
    (tiny / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "gptq"}}))
    r = subprocess.run([sys.executable, "-m", "ringsched.launch", "--model", str(tiny), "--pp-size", "2"],
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 2 and "quantization_config (quant_method 'gptq')" in r.stderr, r.stderr
    assert "ready" not in r.stderr + r.stdout
