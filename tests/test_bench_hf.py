"""`ringsched.bench hf` on the tiny random Llama: both transformers modes run and produce every token."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from ringsched.bench.__main__ import main  # noqa: E402

pytestmark = pytest.mark.slow  # real model or several processes: the full suite's


def test_bench_hf_both_modes(tiny_llama_dir, capsys):
    n, out_len = 6, 4
    rc = main(["hf", "--model", str(tiny_llama_dir), "--num-prompts", str(n), "--input-len", "8",
               "--output-len", str(out_len), "--batch-sizes", "2,4", "--warmup-prompts", "2", "--json"])  # fmt: skip
    assert rc == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    gen = result["generate"]
    assert set(gen["per_batch_size"]) == {"2", "4"}
    assert all(v > 0 for v in gen["per_batch_size"].values())
    assert gen["output_tokens"] == {"2": n * out_len, "4": n * out_len}
    assert gen["best_batch_size"] in (2, 4)
    cb = result["generate_batch"]
    assert "error" not in cb, cb
    assert cb["output_tokens_per_s"] > 0
    assert cb["output_tokens"] == n * out_len
    # Both modes are greedy over the same weights: the same tokens.
    assert cb["same_tokens_as_generate"] == n
    assert result["best_output_tokens_per_s"] >= gen["best_output_tokens_per_s"]


def test_bench_hf_without_generate_batch(tiny_llama_dir, capsys):
    n, out_len = 4, 3
    rc = main(["hf", "--model", str(tiny_llama_dir), "--num-prompts", str(n), "--input-len", "8",
               "--output-len", str(out_len), "--batch-sizes", "4", "--warmup-prompts", "2", "--no-generate-batch",
               "--json"])  # fmt: skip
    assert rc == 0
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    assert result["generate_batch"] is None
    assert "generate_batch:" not in out
    assert result["generate"]["output_tokens"] == {"4": n * out_len}
    assert result["best_output_tokens_per_s"] == result["generate"]["best_output_tokens_per_s"]
