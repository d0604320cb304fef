"""`scripts/make_checkpoint.py`: each named shape has the parameter count its model card gives (so the shapes are the
real ones), and a checkpoint it writes, sharded, loads and serves."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

from ringsched.models.checkpoint_check import expected_shapes
from ringsched.weights.model_config import ModelConfig

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "make_checkpoint.py"
_spec = importlib.util.spec_from_file_location("make_checkpoint", SCRIPT)
make_checkpoint = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_checkpoint)

# Parameters of each model as published (the safetensors' total), which the named shape must reproduce.
PUBLISHED = {
    "llama-3.1-8b": 8_030_261_248, "qwen3-8b": 8_190_735_360, "qwen2.5-7b": 7_615_616_512,
    "mistral-7b-v0.1": 7_241_732_096, "gemma-2-9b": 9_241_705_984, "mixtral-8x7b": 46_702_792_704,
    "qwen3-30b-a3b": 30_532_122_624,
}  # fmt: skip


def test_every_shape_is_published():
    assert set(PUBLISHED) == set(make_checkpoint.LIKE)


@pytest.mark.parametrize("like", sorted(PUBLISHED))
def test_a_named_shape_has_the_published_parameter_count(like):
    cfg = ModelConfig.from_dict(make_checkpoint.LIKE[like])
    shapes = expected_shapes(cfg)
    if cfg.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    assert sum(math.prod(s) for s in shapes.values()) == PUBLISHED[like]


def test_a_written_checkpoint_is_sharded_and_loads(tmp_path, monkeypatch):
    from ringsched.layout.rank import StageInfo
    from ringsched.models.loader import load_stage_model

    config = {**make_checkpoint.LIKE["qwen3-30b-a3b"], "hidden_size": 64, "intermediate_size": 96,
              "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 16, "vocab_size": 300, "num_experts": 4, "num_experts_per_tok": 2}  # fmt: skip
    monkeypatch.setattr(make_checkpoint, "SHARD_BYTES", 64 << 10)
    cfg = ModelConfig.from_dict(config)
    total = make_checkpoint.write_weights(tmp_path, cfg, torch.bfloat16, seed=0)
    (tmp_path / "config.json").write_text(json.dumps(config))
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) > 1 and all((tmp_path / f).exists() for f in files)
    assert index["metadata"]["total_size"] == total == 2 * sum(math.prod(s) for s in expected_shapes(cfg).values())
    model = load_stage_model(tmp_path, StageInfo(0, 1, 0, 2), torch.bfloat16)
    out = model(model_batch(5), input_ids=torch.arange(5))
    assert out.shape == (5, 64) and torch.isfinite(out.float()).all()


def model_batch(n: int):
    from ringsched.attention.paged import ForwardBatch

    return ForwardBatch.no_cache(n)
