"""The hardware decisions of `ringsched/device.py` as pure functions, and the launcher's refusal of `--device cuda`
on a machine without CUDA (a subprocess, so nothing of the model is loaded)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ringsched.device import gpu_shortfall, resolve_dtype, usable_cpus

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
