"""A bad model is one line before any stage starts (`weights/model_files.py`, `spec.ModelSpec.resolve`): each case
below is a copy of a tiny model spoiled one way, resolved as the launcher and the engine do; the line names the
file and the fault. One case also goes through the launcher: exit 2, a few lines, no traceback. Last, the
fingerprint by which the nodes of a ring check that they run the same model."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ringsched.config import EngineConfig
from ringsched.spec import ModelSpec
from ringsched.weights.fetch import FetchError
from ringsched.weights.model_files import BadModelError

ROOT = Path(__file__).resolve().parent.parent


def _edit_config(d: Path, **fields) -> None:
    raw = json.loads((d / "config.json").read_text())
    for k, v in fields.items():
        if v is None:
            raw.pop(k, None)
        else:
            raw[k] = v
    (d / "config.json").write_text(json.dumps(raw))


def _cut(d: Path) -> None:
    w = d / "model.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])


def _garble_header(d: Path) -> None:
    w = d / "model.safetensors"
    w.write_bytes(b"\xff" * 8 + w.read_bytes()[8:])


def _shards_missing(d: Path) -> None:
    (d / "model.safetensors").rename(d / "model-00001-of-00002.safetensors")
    index = {"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                            "model.norm.weight": "model-00002-of-00002.safetensors"}}  # fmt: skip
    (d / "model.safetensors.index.json").write_text(json.dumps(index))


CASES = {
    "weights cut short": (_cut, r"model\.safetensors is cut short: \d+ bytes, its header places \d+"),
    "weights header garbled": (_garble_header, r"model\.safetensors: not a readable safetensors file"),
    "no weights": (lambda d: (d / "model.safetensors").unlink(), r"has no model\.safetensors"),
    "a shard missing": (_shards_missing, r"model-00002-of-00002\.safetensors, named in .* does not exist"),
    "vocab_size 10^9": (lambda d: _edit_config(d, vocab_size=10**9), r"vocab_size = 1000000000 is out of"),
    "vocab_size off by one": (
        lambda d: _edit_config(d, vocab_size=513),
        r"model\.safetensors: model\.embed_tokens\.weight is \[512, 64\], but .*config\.json implies \[513, 64\]",
    ),
    "hidden_size 0": (lambda d: _edit_config(d, hidden_size=0), r"config\.json: hidden_size = 0 is out of range"),
    "heads missing": (
        lambda d: _edit_config(d, num_attention_heads=None),
        r"config\.json: num_attention_heads is missing",
    ),
    "heads a string": (
        lambda d: _edit_config(d, num_attention_heads="4"),
        r'config\.json: num_attention_heads = "4" is out of range',
    ),
    "config not JSON": (
        lambda d: (d / "config.json").write_text('{"hidden_size": 64,'),
        r"config\.json: not valid JSON \(.* at line 1",
    ),
    "no tokenizer": (lambda d: (d / "tokenizer.json").unlink(), r"has no tokenizer\.json"),
}


@pytest.fixture
def spoiled(tiny_llama_dir, tmp_path):
    def make(case: str) -> Path:
        d = tmp_path / case.replace(" ", "-")
        shutil.copytree(tiny_llama_dir, d)
        CASES[case][0](d)
        return d

    return make


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_model_is_one_line_naming_the_file_and_the_fault(spoiled, case):
    d = spoiled(case)
    with pytest.raises(BadModelError, match=CASES[case][1]) as e:
        ModelSpec.resolve(EngineConfig(model=str(d), device="cpu"))
    assert "\n" not in str(e.value) and str(d) in str(e.value)


def test_a_gguf_file_with_a_garbled_header_is_one_line(smollm2_gguf, tmp_path):
    bad = tmp_path / "garbled.gguf"
    with open(smollm2_gguf, "rb") as f:
        head = f.read(1 << 16)
    bad.write_bytes(head[:24] + b"\xff" * 64 + head[88:])  # magic and version kept, the first keys garbled
    with pytest.raises(FetchError, match=r"garbled\.gguf': could not read it as a GGUF file") as e:
        ModelSpec.resolve(EngineConfig(model=str(bad), device="cpu"))
    assert "\n" not in str(e.value)


def test_the_launcher_says_it_in_one_line_and_exits_2(spoiled):
    d = spoiled("vocab_size off by one")  # (every case above takes this path: `cli_args.resolve_args`)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-m", "ringsched.launch", "--model", str(d), "--pp-size", "2"],
                         capture_output=True, text=True, timeout=60, env=env)  # fmt: skip
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) <= 3 and "Traceback" not in run.stderr, run.stderr
    assert str(d) in lines[-1]


def test_nodes_compare_a_model_by_its_content_not_its_path(tiny_llama_dir, tmp_path):
    """The rendezvous' model fingerprint: a byte-identical copy elsewhere is the same model; another config, or
    weights of another layout, are not."""
    from ringsched.process.rendezvous import model_fingerprint

    here = model_fingerprint(str(tiny_llama_dir))
    copy = tmp_path / "elsewhere"
    shutil.copytree(tiny_llama_dir, copy)
    assert model_fingerprint(str(copy)) == here
    _edit_config(copy, rms_norm_eps=1e-3)
    assert model_fingerprint(str(copy)) != here
    other = tmp_path / "other-weights"
    shutil.copytree(tiny_llama_dir, other)
    _cut(other)
    assert model_fingerprint(str(other)) != here
