"""Flags are validated where the config is built, with errors that name the flag and the fix."""

import subprocess
import sys

import pytest

from ringsched.config import ConfigError, EngineConfig, parse_memory


@pytest.mark.parametrize(
    "kw,needle",
    [
        ({"pp_size": 0}, "--pp-size must be >= 1"),
        ({"pp_async_batch_depth": -1}, "--pp-async-batch-depth must be >= 0"),
        ({"pp_max_micro_batch_size": 0}, "--pp-max-micro-batch-size must be >= 1"),
        ({"max_running_requests": 0}, "--max-running-requests"),
        ({"quantization": "int3"}, "--quantization"),
        ({"chunked_prefill_size": 0}, "--chunked-prefill-size"),
        ({"dtype": "float8"}, "--dtype 'float8' is not supported"),
        ({"device": "tpu"}, "--device 'tpu'"),
        ({"dtype": "float16", "device": "cpu"}, "float16 is for GPUs"),
        ({"threads_per_stage": 0}, "--threads-per-stage"),
        ({"cuda_graph_max_bs": 0}, "--cuda-graph-max-bs"),
        ({"pp_auto_output_len": 0}, "--pp-auto-output-len must be >= 1"),
        ({"kv_cache_memory": "lots"}, "--kv-cache-memory"),
        ({"nnodes": 2, "pp_size": 3, "dist_init_addr": "h:1"}, "--nnodes 2 must divide --pp-size 3"),
        ({"nnodes": 2, "pp_size": 2, "node_rank": 2, "dist_init_addr": "h:1"}, "--node-rank 2"),
        ({"nnodes": 2, "pp_size": 2}, "--dist-init-addr HEAD:PORT"),
        ({"stage_timeout": 0}, "--stage-timeout"),
        ({"heartbeat_timeout": 0.5}, "--heartbeat-timeout"),
        ({"cp_size": 0}, "--cp-size must be >= 1"),
        ({"cp_size": 2, "tp_size": 2}, "--cp-size 2 with --tp-size 2: a stage is either tensor-parallel or context"),
        ({"cp_size": 2, "pp_size": 2, "pp_flex_layers": 2}, "--pp-flex-layers runs with --cp-size 1 only"),
    ],
)
def test_bad_flags_name_the_flag(kw, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
        EngineConfig(**kw)


def test_running_requests_default_scales_with_the_stages():
    """With no --max-running-requests each micro-batch of PP=N holds what PP=1's one batch holds."""
    one, two, four = (EngineConfig(pp_size=n) for n in (1, 2, 4))
    assert one.micro_batch_size == two.micro_batch_size == four.micro_batch_size == one.max_running_requests
    assert two.max_running_requests == 2 * one.max_running_requests
    assert EngineConfig(pp_size=2, max_running_requests=64).micro_batch_size == 32  # a set value is split


def test_derived_values():
    cfg = EngineConfig(pp_size=4, pp_async_batch_depth=1, max_running_requests=256, nnodes=2, dist_init_addr="h:1",
                       node_rank=1)
    assert cfg.pp_loop_size == 5 and cfg.micro_batch_size == 64
    assert list(cfg.local_ranks) == [2, 3] and cfg.node_of(3) == 1
    assert EngineConfig(max_running_requests=1, pp_size=3).micro_batch_size == 1
    assert EngineConfig(pp_max_micro_batch_size=7).micro_batch_size == 7
    cp = EngineConfig(pp_size=2, cp_size=2)
    assert cp.world_size == 4 and cp.layout.rank_of(1, 0, 1) == 3
    assert [cp.describe_rank(r) for r in (0, 3)] == ["rank 0 (stage 0, cp 0)", "rank 3 (stage 1, cp 1)"]
    with pytest.raises(ConfigError, match="sums to 31"):
        EngineConfig(pp_size=2, pp_layer_partition="16,15").partition(30)
    with pytest.raises(ConfigError, match="more stages than"):
        EngineConfig(pp_size=31).partition(30)


def test_partition_as_a_list_from_python():
    # Engine(pp_layer_partition=[16, 14]) reads as naturally as the flag's "16,14"; both become one form.
    cfg = EngineConfig(pp_size=2, pp_layer_partition=[16, 14])
    assert cfg.pp_layer_partition == "16,14" and cfg.partition(30) == [16, 14]
    assert EngineConfig(pp_size=2, pp_layer_partition=(16, 14)) == EngineConfig(pp_size=2, pp_layer_partition="16,14")
    with pytest.raises(ConfigError, match="sums to 31"):
        EngineConfig(pp_size=2, pp_layer_partition=[16, 15]).partition(30)
    with pytest.raises(ConfigError, match="as integers"):
        EngineConfig(pp_size=2, pp_layer_partition=[16, "14"])


def test_memory_sizes():
    assert parse_memory("2G") == 2 * 2**30 and parse_memory("512MiB") == 512 * 2**20 and parse_memory(1000) == 1000
    assert parse_memory("0.3") == 0.3


def test_cli_errors_exit_2_with_the_flag():
    for args, needle in ((["--pp-size", "40"], "--pp-size 40"), (["--pp-layer-partition", "1,1"], "sums to 2"),
                         (["--pp-async-batch-depth", "-2"], "--pp-async-batch-depth")):
        p = subprocess.run([sys.executable, "-m", "ringsched.generate", "hi", "--pp-size", "2", *args],
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 2 and needle in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_server_flag_errors_exit_2_with_the_flag():
    for args, needle in ((["--max-request-bytes", "10"], "--max-request-bytes"),
                         (["--heartbeat-timeout", "0"], "--heartbeat-timeout"),
                         (["--max-queued-requests", "-1"], "--max-queued-requests")):  # fmt: skip
        p = subprocess.run([sys.executable, "-m", "ringsched.launch", *args],
                           capture_output=True, text=True, timeout=120)  # fmt: skip
        assert p.returncode == 2 and needle in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_a_fractional_kv_budget_shares_the_node_among_its_own_stages():
    import torch

    from ringsched.stage.kv_setup import kv_budget_bytes

    cpu = torch.device("cpu")
    two_nodes = EngineConfig(pp_size=4, nnodes=2, dist_init_addr="h:1", kv_cache_memory="0.5")
    assert kv_budget_bytes(two_nodes, cpu, free=8 * 2**30) == 2 * 2**30  # 2 stages here, not 4
    assert kv_budget_bytes(EngineConfig(pp_size=2, kv_cache_memory="0.5"), cpu, free=8 * 2**30) == 2 * 2**30
    assert kv_budget_bytes(EngineConfig(pp_size=2, kv_cache_memory="512M"), cpu, free=1) == 512 * 2**20


def test_every_flag_has_help_and_shows_its_default():
    from ringsched.launch import build_parser

    parser = build_parser()
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        assert action.help, f"{action.option_strings[0]} has no help"
        shown = parser._get_formatter()._get_help_string(action)
        assert "default" in shown, f"{action.option_strings[0]}: its help says nothing of its default"
