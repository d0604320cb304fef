"""`bench offline`'s accounting: the FLOP formula and the memory budget on hand-made inputs, then one real run
on a tiny random model that must report time fractions, efficiency and memory for both stages."""

from __future__ import annotations

import argparse

import pytest

from ringsched.bench.efficiency import (
    FlopModel,
    layer_flops_per_token,
    layer_matmul_params,
    lm_head_flops_per_row,
    mean_context,
)
from ringsched.bench.memory import OVERHEAD_BUDGET_BYTES, format_memory, stage_memory
from ringsched.bench.offline import add_offline_args, offline_config, run_offline
from ringsched.process.cli_args import add_engine_args, config_from_args
from ringsched.weights.model_config import ModelConfig

pytestmark = pytest.mark.slow  # real model or several processes: the full suite's

MIB = 2**20


def _tiny() -> ModelConfig:
    return ModelConfig.from_dict({
        "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2, "hidden_size": 8, "intermediate_size": 16,
        "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 10,
    })  # fmt: skip


def test_flops_of_a_hand_computed_config():
    m = _tiny()  # head_dim 4: q 8x8, k and v 8x4 each, o 8x8, gate/up/down 8x16 each
    assert layer_matmul_params(m) == 64 + 32 + 32 + 64 + 3 * 128 == 576
    assert layer_flops_per_token(m, context=5) == 2 * 576 + 4 * 5 * 2 * 4 == 1312
    assert lm_head_flops_per_row(m) == 2 * 8 * 10
    # prompt of 3 then 2 new tokens: computed positions 0..3 attend to 1..4 positions, mean 2.5
    assert mean_context(3, 2) == 2.5
    flops = FlopModel.of(m, 5)
    assert flops.stage_flops(tokens=7, layers=2, sample_rows=3) == 7 * 2 * 1312 + 3 * 160


def test_memory_budget_arithmetic():
    info = {"weights_bytes": 100 * MIB, "kv_bytes": 200 * MIB}
    ok = stage_memory({"peak_rss_bytes": 550 * MIB, "peak_device_bytes": 0}, info)
    assert ok["source"] == "rss" and ok["overhead_bytes"] == 250 * MIB and ok["within_budget"]
    assert format_memory(ok) == "peak 550 MiB = weights 100 + KV 200 + 250 overhead"
    edge = stage_memory({"peak_rss_bytes": 300 * MIB + OVERHEAD_BUDGET_BYTES, "peak_device_bytes": 0}, info)
    assert edge["within_budget"]
    over = stage_memory({"peak_rss_bytes": 601 * MIB, "peak_device_bytes": 0}, info)
    assert not over["within_budget"] and "over the 300 MiB budget" in format_memory(over)
    gpu = stage_memory({"peak_rss_bytes": 5000 * MIB, "peak_device_bytes": 310 * MIB}, info)
    assert gpu["source"] == "device" and gpu["overhead_bytes"] == 10 * MIB


@pytest.mark.timeout(120)
def test_offline_reports_time_efficiency_and_memory_per_stage(tiny_llama_dir, capsys):
    p = argparse.ArgumentParser()
    add_offline_args(p)
    args = p.parse_args([
        "--model", str(tiny_llama_dir), "--pp-size", "2", "--threads-per-stage", "1", "--kv-cache-memory", "16M",
        "--num-prompts", "8", "--input-len", "16", "--output-len", "8", "--warmup-prompts", "2", "--json",
    ])  # fmt: skip
    r = run_offline(args)
    assert len(r["stage_time_fractions"]) == len(r["efficiency"]) == len(r["stage_memory"]) == 2
    for f in r["stage_time_fractions"]:
        assert set(f) == {"compute", "wait", "sched", "comm"}
        assert all(0.0 <= v <= 1.05 for v in f.values()), f
        assert sum(f.values()) <= 1.05, f
    deltas = r["runs"][0]["stage_deltas"]
    # every stage runs every token of the 8 requests: the prompt and all new tokens but the last
    assert [d["tokens"] for d in deltas] == [8 * (16 + 8 - 1)] * 2
    assert deltas[0]["sample_rows"] == 0 and deltas[1]["sample_rows"] == 8 * 8
    assert r["matmul_reference"]["gflops_per_s"] > 0
    assert all(e > 0 for e in r["efficiency"])
    for m in r["stage_memory"]:
        assert m["peak_bytes"] > m["weights_bytes"] > 0 and m["kv_bytes"] > 0
    out = capsys.readouterr().out
    assert "stage 1: compute" in out and "GFLOP/s model" in out and "overhead" in out


def test_auto_balances_for_the_benchmarks_requests(tiny_llama_dir):
    p = argparse.ArgumentParser()
    add_offline_args(p)
    base = ["--model", str(tiny_llama_dir), "--input-len", "32", "--output-len", "64"]
    cfg = offline_config(p.parse_args(base))
    assert (cfg.pp_auto_input_len, cfg.pp_auto_output_len) == (32, 64)
    cfg = offline_config(p.parse_args([*base, "--pp-auto-input-len", "500"]))
    assert (cfg.pp_auto_input_len, cfg.pp_auto_output_len) == (500, 64)
    # Other entry points take the flags' defaults.
    q = argparse.ArgumentParser()
    add_engine_args(q)
    cfg = config_from_args(q.parse_args(["--model", str(tiny_llama_dir)]))
    assert (cfg.pp_auto_input_len, cfg.pp_auto_output_len) == (128, 128)


def test_offline_reports_each_ranks_seam_and_all_reduces_at_tp(tiny_llama_dir, capsys):
    """PP=2 x TP=2 on the tiny Llama (hidden 64, 3 layers a stage): stage 0's ranks each send half the seam,
    2 x 64 x 4 / 2 bytes per token; every rank all-reduces twice per layer, stage 0 once more (the embedding)."""
    p = argparse.ArgumentParser()
    add_offline_args(p)
    args = p.parse_args([
        "--model", str(tiny_llama_dir), "--pp-size", "2", "--tp-size", "2", "--threads-per-stage", "1",
        "--kv-cache-memory", "16M", "--num-prompts", "4", "--input-len", "16", "--output-len", "8",
        "--warmup-prompts", "1", "--json",
    ])  # fmt: skip
    r = run_offline(args)
    assert r["tp_size"] == 2 and len(r["stage_memory"]) == 2 and len(r["rank_memory"]) == 4
    wire = {w["rank"]: w for w in r["rank_wire"]}
    assert [(w["stage"], w["tp"]) for w in r["rank_wire"]] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [wire[k]["seam_bytes_per_token"] for k in range(4)] == [256, 256, 0, 0]
    assert [wire[k]["tp_all_reduces_per_batch"] for k in range(4)] == [7, 7, 6, 6]
    assert [wire[k]["tp_all_reduce_bytes_per_token"] for k in range(4)] == [7 * 256, 7 * 256, 6 * 256, 6 * 256]
    assert "rank 3 (stage 1, tp 1): seam 0 B/token, 6 all-reduces/batch" in capsys.readouterr().out


@pytest.mark.timeout(120)
def test_long_prompt_ttft_and_decodes_beside_it(tiny_llama_dir, capsys):
    """`--long-prompt`: the TTFT of single prompts (median of the repeats), and with `--decoding-streams` the
    streams' TPOT before and while the prompt prefills; with dynamic chunking on, the probe runs at start-up."""
    p = argparse.ArgumentParser()
    add_offline_args(p)
    base = ["--model", str(tiny_llama_dir), "--pp-size", "2", "--threads-per-stage", "1", "--kv-cache-memory", "16M",
            "--long-prompt", "400", "--chunked-prefill-size", "64", "--warmup-prompts", "1"]  # fmt: skip
    r = run_offline(p.parse_args([*base, "--repeat", "3"]))
    assert r["long_prompt"] == 400 and len(r["ttft_runs_s"]) == 3 and r["ttft_s"] == sorted(r["ttft_runs_s"])[1]
    assert "a 400-token prompt: TTFT" in capsys.readouterr().out
    r = run_offline(p.parse_args([*base, "--decoding-streams", "4", "--input-len", "8",
                                  "--enable-dynamic-chunking"]))  # fmt: skip
    assert r["decoding_streams"] == 4 and r["dynamic_chunking"] and r["ttft_s"] > 0
    assert r["tpot_before_s"] > 0 and r["tpot_during_s"] > 0
    assert r["tpot_ratio"] == pytest.approx(r["tpot_during_s"] / r["tpot_before_s"])
    assert "beside 4 decoding streams" in capsys.readouterr().out
