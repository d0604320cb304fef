"""`ringsched.plan` reproduces the design document's Llama-3-70B derivation, loads every preset, reads a
model directory like the matching preset, and refuses bad input with an error that names the flag.

The acceptance case: Llama-3-70B in bf16 on 16 H100 SXM 80 GB, two nodes of 8, 400 Gb/s between them,
--mem-fraction 0.9, 3 GiB reserved, T = 64 tokens per step, max model length 8192. Figures within 2%.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ringsched.capacity import (
    GPU_PRESETS,
    MODEL_PRESETS,
    CapacityError,
    ClusterSpec,
    bubble_fraction,
    layout_row,
    load_gpu,
    load_model,
)
from ringsched.capacity.report import json_rows
from ringsched.capacity.sweep import make_layouts
from ringsched.plan import main

REPO = Path(__file__).resolve().parents[1]
KIB, MIB = 2**10, 2**20
REL = 0.02

LLAMA_70B_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_attention_heads": 64,
    "num_hidden_layers": 80,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
}


@pytest.fixture(autouse=True)
def _no_partition_override(monkeypatch):
    # The server's env override would change every split the planner computes.
    monkeypatch.delenv("RINGSCHED_PP_LAYER_PARTITION", raising=False)


def approx(x: float) -> object:
    return pytest.approx(x, rel=REL)


@pytest.fixture
def cluster() -> ClusterSpec:
    return ClusterSpec(
        gpu=load_gpu("h100-sxm-80gb"),
        gpus=16,
        gpus_per_node=8,
        inter_node_gbps=400,
        mem_fraction=0.9,
        reserve_gib=3,
        max_model_len=8192,
        batch_tokens=64,
    )


@pytest.fixture
def plan(cluster):
    return make_layouts(load_model("llama-3-70b"), cluster)


def row(plan, tp: int, pp: int):
    (found,) = [r for r in plan.rows if (r.tp, r.pp) == (tp, pp)]
    return found


def test_weights_131_gib_and_16_4_per_gpu_at_tp8(plan):
    assert plan.derivation.weights_gib == approx(131)
    assert plan.baseline is not None and (plan.baseline.tp, plan.baseline.pp) == (8, 1)
    assert plan.baseline.weights_per_gpu_gib == approx(16.4)
    # 79.65 GiB x 0.9 = 71.69 usable, 3 reserved: ~52 GiB of KV space at TP=8, as the document says.
    assert plan.cluster.usable_gib == approx(71.69)
    assert plan.baseline.kv_space_per_gpu_gib == approx(52.26)


def test_tp8_allreduce_traffic(plan):
    d = plan.derivation
    assert d.tp == 8
    assert d.allreduce_bytes == approx(1.84e6)
    assert d.collectives_per_step == 160
    assert d.tp_bytes_per_rank_per_step == approx(294e6)
    assert d.tp_ms_intra_node == approx(0.65)
    assert d.tp_ms_inter_node == approx(5.9)
    # The one-node TP=8 row carries exactly that traffic over NVLink.
    assert plan.baseline.comm_bytes_per_rank_per_step == approx(294e6)
    assert plan.baseline.comm_ms_per_step == approx(0.65)
    assert plan.baseline.tp_link == "nvlink"


def test_seam_against_tp_per_token(plan):
    d = plan.derivation
    assert d.seam_bytes_per_token == 32 * KIB
    assert d.seam_bytes_per_token_per_rank == 4 * KIB
    assert d.tp_bytes_per_token_per_rank == approx(4.375 * MIB)
    assert d.tp_to_seam_ratio == approx(140)
    r = row(plan, 8, 2)
    assert r.seam_bytes_per_rank_per_step == 64 * 4 * KIB
    assert (r.tp_link, r.seam_link) == ("nvlink", "inter-node")
    # TP=16 cannot stay in a node: its all-reduces ride the 50 GB/s link and cost more than the compute.
    assert row(plan, 16, 1).tp_link == "inter-node"
    assert row(plan, 16, 1).comm_ms_per_step > row(plan, 16, 1).ideal_token_latency_ms


def test_kv_per_token(plan):
    assert plan.derivation.kv_bytes_per_token_per_layer == 4 * KIB
    assert plan.derivation.kv_bytes_per_token == 320 * KIB
    # Past h_kv = 8 heads are replicated: TP=16 stores as much KV per token per GPU as TP=8; PP=2 halves it.
    assert plan.baseline.kv_bytes_per_token_per_gpu == 40 * KIB
    assert row(plan, 16, 1).kv_bytes_per_token_per_gpu == 40 * KIB
    assert row(plan, 8, 2).kv_bytes_per_token_per_gpu == 20 * KIB


def test_concurrency_against_tp8_alone(plan):
    tp16, tp8pp2 = row(plan, 16, 1), row(plan, 8, 2)
    assert 1 + tp16.concurrency_vs_one_node == approx(1.16)
    assert 1 + tp8pp2.concurrency_vs_one_node == approx(2.32)
    # Whole sequences at 8192 tokens.
    assert tp16.concurrent_sequences == tp16.token_capacity // 8192
    assert tp16.concurrent_sequences / plan.baseline.concurrent_sequences == approx(1.16)
    assert tp8pp2.concurrent_sequences / plan.baseline.concurrent_sequences == approx(2.32)


@pytest.mark.parametrize("m, expected", [(1, 0.75), (4, 0.429), (16, 0.158), (64, 0.045)])
def test_bubble_at_four_stages(cluster, m, expected):
    assert bubble_fraction(4, m) == approx(expected)
    r = layout_row(load_model("llama-3-70b"), dataclasses.replace(cluster, in_flight=m), 4, 4)
    assert r.bubble == approx(expected)


def test_bubble_defaults_to_pp_batches_in_flight(plan):
    r = row(plan, 8, 2)
    assert r.in_flight == 2 and r.bubble == approx(1 / 3)


def test_uneven_partition_at_pp6(cluster):
    r = layout_row(load_model("llama-3-70b"), dataclasses.replace(cluster, gpus=48), 8, 6)
    assert r.partition == [13, 13, 13, 14, 14, 13]
    assert r.uneven_loss == approx(0.048)
    # A 14-layer stage holds the most KV per token, so it binds capacity.
    assert r.partition[r.binding_stage] == 14


def test_latency_is_weight_bandwidth_and_pp_does_not_cut_it(plan):
    # W / (TP x B_HBM): the document's 5.17 ms at TP=8 ("a 5.2 ms step").
    assert plan.baseline.ideal_token_latency_ms == approx(5.17)
    assert row(plan, 8, 2).ideal_token_latency_ms == approx(plan.baseline.ideal_token_latency_ms)


def test_recommends_tp_inside_node_pp_across(plan):
    rec = plan.recommendation
    assert rec.row is not None and (rec.row.tp, rec.row.pp) == (8, 2)
    assert rec.reason.startswith("TP=8 x PP=2")


@pytest.mark.parametrize(
    "model, gpu, gpus",
    [
        ("llama-3-8b", "h100-sxm-80gb", 1),
        ("llama-3-70b", "h200-141gb", 2),
        ("llama-3-405b", "h100-sxm-80gb", 16),
        ("qwen3-32b", "a100-80gb", 2),
        ("smollm2-135m-instruct", "l40s-48gb", 1),
    ],
)
def test_every_model_preset_plans(model, gpu, gpus):
    cluster = ClusterSpec(gpu=load_gpu(gpu), gpus=gpus, gpus_per_node=8)
    p = make_layouts(load_model(model), cluster)
    assert p.rows and all(r.fits for r in p.rows)
    assert p.recommendation.row is not None


def test_every_preset_loads():
    models = {"llama-3-8b", "llama-3-70b", "llama-3-405b", "qwen3-32b", "smollm2-135m-instruct"}
    assert set(MODEL_PRESETS) >= models
    assert set(GPU_PRESETS) >= {"h100-sxm-80gb", "h200-141gb", "a100-80gb", "l40s-48gb"}
    for name in MODEL_PRESETS:
        assert load_model(name).name == name
    for name in GPU_PRESETS:
        assert load_gpu(name).memory_gib > 0
    assert load_gpu("h100-sxm-80gb").memory_gib == 79.65
    # Published sizes, as a check on the shapes: 8.0B, 70.6B, 405.9B, 32.8B, 134.5M parameters.
    from ringsched.capacity.memory import total_weight_bytes

    params = {name: total_weight_bytes(m) / m.dtype_bytes for name, m in MODEL_PRESETS.items()}
    assert params["llama-3-8b"] == approx(8.03e9)
    assert params["llama-3-70b"] == approx(70.55e9)
    assert params["llama-3-405b"] == approx(405.85e9)
    assert params["qwen3-32b"] == approx(32.76e9)
    assert params["smollm2-135m-instruct"] == approx(134.5e6)


def test_model_directory_matches_preset(tmp_path, cluster):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_70B_CONFIG))
    from_dir = load_model(str(tmp_path))
    preset = load_model("llama-3-70b")
    assert dataclasses.replace(from_dir, name=preset.name) == preset
    assert json_rows(make_layouts(from_dir, cluster).rows) == json_rows(make_layouts(preset, cluster).rows)


def test_config_dtype_and_family_fields(tmp_path):
    qwen2 = {**LLAMA_70B_CONFIG, "architectures": ["Qwen2ForCausalLM"], "torch_dtype": "float32"}
    (tmp_path / "config.json").write_text(json.dumps(qwen2))
    m = load_model(str(tmp_path))
    assert m.dtype_bytes == 4 and m.qkv_bias and not m.qk_norm
    qwen3 = {k: v for k, v in LLAMA_70B_CONFIG.items() if k != "torch_dtype"}
    qwen3 |= {"architectures": ["Qwen3ForCausalLM"], "head_dim": 128}
    (tmp_path / "config.json").write_text(json.dumps(qwen3))
    m = load_model(str(tmp_path))
    assert m.dtype_bytes == 2 and m.qk_norm  # bf16 when the config names no dtype


def test_error_tp_times_pp_not_gpus(cluster):
    with pytest.raises(CapacityError, match=r"--tp 8 x --pp 4 = 32 GPUs but --gpus is 16"):
        layout_row(load_model("llama-3-70b"), cluster, 8, 4)


def test_error_tp_not_dividing_heads(cluster):
    with pytest.raises(CapacityError, match=r"--tp 3 does not divide llama-3-70b's 64 attention heads"):
        layout_row(load_model("llama-3-70b"), dataclasses.replace(cluster, gpus=3), 3, 1)


def test_error_unknown_presets_and_architecture(tmp_path):
    with pytest.raises(CapacityError, match=r"unknown --model 'llama-4'.*llama-3-70b"):
        load_model("llama-4")
    with pytest.raises(CapacityError, match=r"unknown --gpu 'h100'.*h100-sxm-80gb"):
        load_gpu("h100")
    moe = {**LLAMA_70B_CONFIG, "architectures": ["MixtralForCausalLM"]}
    (tmp_path / "config.json").write_text(json.dumps(moe))
    with pytest.raises(CapacityError, match="MixtralForCausalLM"):
        load_model(str(tmp_path))


def test_error_invalid_specs(cluster):
    with pytest.raises(CapacityError, match="--mem-fraction"):
        dataclasses.replace(cluster, mem_fraction=1.5)
    with pytest.raises(CapacityError, match="--num-kv-heads 5 does not divide --num-heads 64"):
        dataclasses.replace(load_model("llama-3-70b"), num_kv_heads=5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cluster.gpus = 8  # type: ignore[misc]


def test_cli_errors_and_overrides(capsys):
    args = ["--model", "llama-3-70b", "--gpu", "h100-sxm-80gb", "--gpus", "16", "--gpus-per-node", "8"]
    assert main([*args, "--tp", "8", "--pp", "4"]) == 2
    assert "--tp 8 x --pp 4 = 32 GPUs but --gpus is 16" in capsys.readouterr().err
    assert main([*args, "--tp", "8", "--json", "--gpu-memory-gib", "159.3", "--dtype-bytes", "1"]) == 0
    (r,) = json.loads(capsys.readouterr().out)
    assert (r["tp"], r["pp"]) == (8, 2)
    assert r["kv_bytes_per_token_per_gpu"] == 10 * KIB  # fp8 KV halves it
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "recommendation: TP=8 x PP=2" in out and "baseline: TP=8 alone on one node" in out


def test_cli_json_subprocess():
    cmd = [sys.executable, "-m", "ringsched.plan", "--model", "llama-3-70b", "--gpu", "h100-sxm-80gb"]
    cmd += ["--gpus", "16", "--gpus-per-node", "8", "--inter-node-gbps", "400", "--mem-fraction", "0.9"]
    cmd += ["--reserve-gib", "3", "--batch-tokens", "64", "--max-model-len", "8192", "--in-flight", "4"]
    cmd += ["--json"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("RINGSCHED_PP_LAYER_PARTITION", None)
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=True)
    rows = {(r["tp"], r["pp"]): r for r in json.loads(done.stdout)}
    assert set(rows) == {(1, 16), (2, 8), (4, 4), (8, 2), (16, 1)}
    keys = {
        "tp", "pp", "weights_per_gpu_gib", "kv_bytes_per_token_per_gpu", "kv_space_per_gpu_gib",
        "token_capacity", "concurrent_sequences", "comm_bytes_per_rank_per_step", "comm_ms_per_step",
        "ideal_token_latency_ms", "partition", "uneven_loss", "bubble",
    }  # fmt: skip
    assert all(keys <= set(r) for r in rows.values())
    # The gain as a ratio to TP=8 alone: TP=16 about 1.16x, TP=8 x PP=2 about 2.32x.
    assert 1 + rows[(16, 1)]["concurrency_vs_one_node"] == approx(1.16)
    assert 1 + rows[(8, 2)]["concurrency_vs_one_node"] == approx(2.32)
    assert rows[(4, 4)]["bubble"] == approx(0.429)
    assert rows[(8, 2)]["partition"] == [40, 40]


def test_print_launch_gives_each_node_its_command_for_the_recommended_layout(capsys):
    argv = ["--model", "llama-3-70b", "--gpu", "h100-sxm-80gb", "--gpus", "16", "--gpus-per-node", "8",
            "--print-launch", "--dist-init-addr", "10.0.0.1:29500"]  # fmt: skip
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    cmds = [ln for ln in lines if ln.startswith("python -m ringsched.launch")]
    assert len(cmds) == 2
    for node, cmd in enumerate(cmds):
        assert "--tp-size 8 --pp-size 2 --dtype bfloat16" in cmd
        assert cmd.endswith(f"--nnodes 2 --node-rank {node} --dist-init-addr 10.0.0.1:29500")
    assert "# node 0: stage 0, 8 GPUs and the OpenAI API" in lines
    # The commands parse as the launcher's own flags (TP inside a node, PP across).
    from ringsched.launch import build_parser

    args = build_parser().parse_args(cmds[1].split()[3:])
    assert (args.tp_size, args.pp_size, args.nnodes, args.node_rank) == (8, 2, 2, 1)
    # ...and build a config the launcher accepts: a model path to fill in, a KV pool, the dtype.
    from ringsched.config import EngineConfig, parse_memory

    assert args.model == "/path/to/llama-3-70b" and args.dtype == "bfloat16"
    kv = parse_memory(args.kv_cache_memory)
    assert isinstance(kv, int) and 10 * 2**30 < kv < 80 * 2**30
    from ringsched.process.cli_args import ENGINE_FLAGS

    EngineConfig(**{k: getattr(args, k) for k in ENGINE_FLAGS if k != "device"}, device="cpu")


def test_print_launch_refuses_a_tensor_parallel_group_wider_than_a_node(capsys):
    argv = ["--model", "llama-3-70b", "--gpu", "h100-sxm-80gb", "--gpus", "16", "--gpus-per-node", "8",
            "--tp", "16", "--pp", "1", "--print-launch"]  # fmt: skip
    assert main(argv) == 2
    assert "TP=16 is wider than a node's 8 GPUs" in capsys.readouterr().err


def test_print_launch_runs_context_parallel_stages_and_refuses_them_with_tp(capsys):
    base = ["--model", "llama-3-8b", "--gpu", "h100-sxm-80gb", "--gpus", "4", "--gpus-per-node", "2", "--print-launch"]
    assert main([*base, "--tp", "1", "--pp", "2", "--cp", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    cmds = [ln for ln in lines if ln.startswith("python -m ringsched.launch")]
    assert len(cmds) == 2 and all("--tp-size 1 --pp-size 2 --cp-size 2" in c for c in cmds)
    assert "# node 1: stage 1, 2 GPUs" in lines
    from ringsched.launch import build_parser

    args = build_parser().parse_args(cmds[0].split()[3:])
    assert (args.cp_size, args.pp_size, args.nnodes) == (2, 2, 2)
    assert main([*base, "--tp", "2", "--pp", "1", "--cp", "2"]) == 2
    assert "either tensor- or context-parallel" in capsys.readouterr().err


def test_context_parallelism_splits_each_sequences_kv_over_a_stages_ranks(cluster):
    """CP=2: each stage's weights on both of its CP ranks, each rank storing half of every sequence's tokens, so
    a stage holds twice what one of its GPUs does. A 2M-token sequence that TP=8 on one node cannot hold fits at
    TP=8 x CP=2, but PP=2 splits the weights as well and holds more still: the planner says so."""
    model = load_model("llama-3-70b")
    cp2 = layout_row(model, cluster, 8, 1, cp=2)
    tp8 = layout_row(model, dataclasses.replace(cluster, gpus=8), 8, 1)
    assert cp2.weights_per_gpu_gib == approx(tp8.weights_per_gpu_gib)  # replicated, not split
    assert cp2.token_capacity == 2 * tp8.token_capacity
    # decode: each layer all-gathers 64 rows x 8 heads x (128 + 1) float32 from the other rank
    assert cp2.cp_bytes_per_rank_per_step == 80 * 64 * 8 * 129 * 4
    # prefill: half of each chunk's K/V (1 KV head per TP rank, bf16) passed on once, every layer
    assert cp2.cp_prefill_bytes_per_token == 80 * 0.5 * 2 * 1 * 128 * 2
    assert cp2.cp_link == "inter-node" and cp2.tp_link == "nvlink"  # CP rank 1's TP group is node 1
    long = dataclasses.replace(cluster, max_model_len=2_000_000)
    assert not layout_row(model, dataclasses.replace(long, gpus=8), 8, 1).fits
    plan = make_layouts(model, long, cp=[1, 2])
    fitting = {(r.tp, r.pp, r.cp): r.token_capacity for r in plan.rows if r.fits}
    assert (8, 1, 2) in fitting and fitting[(8, 2, 1)] > fitting[(8, 1, 2)]
    assert plan.recommendation.reason.startswith("TP=8 x PP=2:")


def test_cp_in_the_report_and_the_cli(capsys):
    base = ["--model", "llama-3-70b", "--gpu", "h100-sxm-80gb", "--gpus", "16", "--gpus-per-node", "8"]
    assert main(base) == 0
    assert " CP " not in capsys.readouterr().out  # no CP asked for: the table as before
    assert main([*base, "--cp", "1", "2"]) == 0
    out = capsys.readouterr().out
    assert " TP   PP   CP " in out and "TP=4 x PP=2 x CP=2: ring attention sends" in out
    assert main([*base, "--cp", "3"]) == 2
    assert "--cp 3 does not divide --gpus 16" in capsys.readouterr().err
    assert main([*base, "--cp", "2", "--tp", "8", "--pp", "1", "--print-launch"]) == 2
    assert "either tensor- or context-parallel" in capsys.readouterr().err


def test_the_planner_counts_gemma_and_phi3_and_refuses_experts():
    from ringsched.capacity.presets import CapacityError, model_from_config

    gemma = {"architectures": ["Gemma2ForCausalLM"], "num_hidden_layers": 42, "hidden_size": 3584,
             "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256, "intermediate_size": 14336,
             "vocab_size": 256000, "torch_dtype": "bfloat16"}  # fmt: skip
    spec = model_from_config(gemma)
    assert spec.tie_embeddings and spec.head_dim == 256 and spec.num_layers == 42
    with pytest.raises(CapacityError, match="MixtralForCausalLM is not one the planner can count"):
        model_from_config({**gemma, "architectures": ["MixtralForCausalLM"]})
