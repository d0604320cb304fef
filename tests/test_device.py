"""The hardware decisions of `ringsched/device.py` as pure functions, and the launcher's refusal of `--device cuda`
on a machine without CUDA (a subprocess, so nothing of the model is loaded)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ringsched.config import ConfigError, EngineConfig
from ringsched.device import activation_reserve, dtype_note, gpu_shortfall, resolve_dtype, usable_cpus

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    ("pp", "nnodes", "tp", "cp", "gpus", "ok"),
    [(1, 1, 1, 1, 1, True), (2, 1, 1, 1, 1, False), (2, 2, 1, 1, 1, True), (2, 1, 2, 1, 4, True),
     (2, 1, 2, 1, 3, False), (4, 2, 1, 2, 4, True), (1, 1, 1, 1, 0, False)],
)  # fmt: skip
def test_gpu_shortfall_counts_this_nodes_ranks(pp, nnodes, tp, cp, gpus, ok):
    msg = gpu_shortfall(pp, nnodes, tp, cp, gpus)
    assert (msg is None) == ok
    if not ok:
        for word in ("--pp-size", "--tp-size", "--cp-size", "CUDA_VISIBLE_DEVICES", f"sees {gpus} GPU"):
            assert word in msg


@pytest.mark.parametrize(
    ("requested", "device", "checkpoint", "want"),
    [("auto", "cpu", {"torch_dtype": "bfloat16"}, "float32"), ("auto", "cuda", {"torch_dtype": "bfloat16"}, "bfloat16"),
     ("auto", "cuda", {"dtype": "float16"}, "float16"), ("auto", "cuda", {}, "bfloat16"),
     ("auto", "cuda", {"torch_dtype": "torch.float32"}, "float32"),
     ("auto", "cuda", {"torch_dtype": "int8"}, "bfloat16"),
     ("bfloat16", "cpu", {}, "bfloat16"), ("float32", "cuda", {"torch_dtype": "bfloat16"}, "float32")],
)  # fmt: skip
def test_resolve_dtype(requested, device, checkpoint, want):
    assert resolve_dtype(requested, device, checkpoint) == want


@pytest.mark.parametrize(
    ("checkpoint", "fast_bf16", "want"),
    [({"torch_dtype": "bfloat16"}, True, "bfloat16"), ({"torch_dtype": "bfloat16"}, False, "float32"),
     ({"dtype": "float16"}, True, "float32"), ({"torch_dtype": "float32"}, True, "float32"), ({}, True, "float32")],
)  # fmt: skip
def test_auto_on_a_cpu_takes_bfloat16_only_where_the_cpu_computes_it(checkpoint, fast_bf16, want):
    assert resolve_dtype("auto", "cpu", checkpoint, fast_bf16) == want
    note = dtype_note(want, "cpu", checkpoint)
    named = checkpoint.get("torch_dtype") or checkpoint.get("dtype")
    assert (note is None) == (named in (None, want))
    if note:
        assert f"the checkpoint is {named}, running {want}" in note and f"--dtype {named}" in note


def test_usable_cpus_prefers_the_affinity_mask():
    assert usable_cpus({3}, 64) == 1
    assert usable_cpus(None, 8) == 8
    assert usable_cpus(set(), None) == 1


def test_default_dtype_on_cpu_is_float32():
    from ringsched.config import EngineConfig

    assert EngineConfig(device="cpu").dtype == "auto"
    assert EngineConfig(device="cpu").torch_dtype == torch.float32


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_launcher_refuses_device_cuda_without_cuda_at_once():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # A model path that does not exist: the refusal must come before anything looks for the model.
    run = subprocess.run([sys.executable, "-m", "ringsched.launch", "--device", "cuda", "--model", "/nonexistent"],
                         capture_output=True, text=True, timeout=60, env=env)  # fmt: skip
    assert run.returncode == 2
    assert run.stderr.strip() == "error: --device cuda was asked for but CUDA is not available; use --device cpu"
    assert "Traceback" not in run.stderr


def test_gpu_check_without_a_gpu_runs_nothing(tmp_path):
    """scripts/gpu_check.sh on a machine without nvidia-smi: says so, exits 0, makes no model."""
    env = {**os.environ, "PATH": f"{tmp_path}:/usr/bin:/bin", "PYTHON": sys.executable, "OUT": str(tmp_path)}
    run = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], capture_output=True, text=True,
                         timeout=60, env=env)  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "no GPU here" in run.stdout
    assert not (tmp_path / "gpu_check.txt").exists()


def test_fractional_kv_budget_on_gpu_leaves_room_for_activations():
    from ringsched.config import EngineConfig
    from ringsched.models.random_model import random_config
    from ringsched.stage.kv_setup import kv_budget_bytes
    from ringsched.weights.model_config import ModelConfig

    mcfg = ModelConfig.from_dict(random_config("llama", 30, 576, 9, 3, 1536, 49152, True))
    cfg, free, gpu = EngineConfig(device="cpu", kv_cache_memory="0.9"), 80 * 2**30, torch.device("cuda", 0)
    reserve = activation_reserve(512 + 128, 128, 576, 1536, 49152)
    assert 2**30 < reserve < 2 * 2**30
    assert kv_budget_bytes(cfg, gpu, free=free, mcfg=mcfg) == int((free - reserve) * 0.9)
    assert kv_budget_bytes(cfg, gpu, free=reserve // 2, mcfg=mcfg) == 0  # nothing left: refused later, not negative
    assert kv_budget_bytes(cfg, torch.device("cpu"), free=free, mcfg=mcfg) == int(free * 0.9)  # CPU unchanged


@pytest.mark.parametrize(("kw", "flag"), [({"pp_size": 2, "pp_flex_layers": 2}, "--pp-flex-layers"),
                                          ({"pp_size": 4}, "CUDA_VISIBLE_DEVICES")])  # fmt: skip
def test_cuda_refuses_what_it_cannot_run(monkeypatch, kw, flag):
    """As on a machine with two GPUs: the flexible cut's unbatched NCCL exchange, and more ranks than GPUs."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    EngineConfig(device="cuda", pp_size=2)  # what fits is taken
    with pytest.raises(ConfigError, match=flag):
        EngineConfig(device="cuda", **kw)
