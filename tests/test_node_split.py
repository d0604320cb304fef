"""The layer split over nodes that are not alike, as plain numbers: each stage priced by its node's measured layer
time (the first node's embedding, the last node's head), capped by the memory its node gives it; the shortfall per
node named when the nodes together cannot hold the model; whether the nodes measure themselves at all (identical
nodes with no partition given keep the default split)."""

from dataclasses import replace

import pytest

from ringsched.config import EngineConfig
from ringsched.layout import node_split as ns
from ringsched.layout.node_split import GIB, NodeSpec, SplitError, StageBytes, describe, split_over_nodes
from ringsched.layout.partition import default_partition, head_layers
from ringsched.process.node_exchange import split_mode, why_measure
from ringsched.process.node_measure import _cgroup_room, stage_bytes
from ringsched.spec import ModelSpec

WEIGHTS = StageBytes(layer=100.0, first=50.0, last=60.0)


def test_a_slower_node_gets_fewer_layers_in_proportion():
    fast, slow = NodeSpec(0, (1.0,), 0.0, 0.0), NodeSpec(1, (2.0,), 0.0, 0.0)
    assert split_over_nodes(30, [fast, slow], WEIGHTS) == [20, 10]
    assert split_over_nodes(30, [slow, fast], WEIGHTS) == [10, 20]
    # the last node's head counts on the last stage: 4 ms is 2 of the slow node's layers
    assert split_over_nodes(30, [fast, NodeSpec(1, (2.0,), 0.0, 4.0)], WEIGHTS) == [21, 9]
    # equal nodes: the even split, the head's weight taken off the last stage as the default split does
    equal = [NodeSpec(0, (1.0,), 0.0, 0.0), NodeSpec(1, (1.0,), 0.0, 4.0)]
    assert split_over_nodes(30, equal, WEIGHTS) == default_partition(30, 2, 4.0) == [17, 13]


def test_a_node_with_less_memory_gets_only_what_it_holds():
    """Node 1 holds 60 (head) + 8 x 100 bytes of layers: 8 layers, though its speed would take 15."""
    nodes = [NodeSpec(0, (1.0,), 0.0, 0.0, memory=None), NodeSpec(1, (1.0,), 0.0, 0.0, memory=860.0)]
    assert split_over_nodes(30, nodes, WEIGHTS) == [22, 8]
    # a node's memory is shared by its stages: two stages of 430 bytes, each its 3 or 4 layers
    two = [NodeSpec(0, (1.0,), 0.0, 0.0), NodeSpec(1, (1.0, 1.0), 0.0, 0.0, memory=860.0)]
    assert split_over_nodes(30, two, WEIGHTS) == [23, 4, 3]
    # KV per layer (a fraction-given pool: one full-context request) counts like weights
    kv = StageBytes(layer=100.0, first=50.0, last=60.0, kv_layer=100.0)
    assert split_over_nodes(30, nodes, kv) == [26, 4]


def test_nodes_that_cannot_hold_the_model_are_refused_naming_each_shortfall():
    nodes = [NodeSpec(0, (1.0,), 0.0, 0.0, memory=1050.0), NodeSpec(1, (1.0,), 0.0, 0.0, memory=0.55 * GIB)]
    big = StageBytes(layer=0.1 * GIB, first=0.0, last=0.0)
    with pytest.raises(SplitError) as e:
        split_over_nodes(30, nodes, big)
    msg = str(e.value)
    assert "node 0" in msg and "node 1" in msg and "--node-memory" in msg
    assert "holds at most 0 layers" in msg and "holds at most 5 layers" in msg  # 1 KiB; 0.55 GiB / 0.1 GiB
    assert "1.50 GiB short" in msg and "0.95 GiB short" in msg  # an even share, 15 layers each, is 1.5 GiB


def test_balanced_split_keeps_every_stage_within_its_cap():
    assert ns.balanced_split(10, lambda k, n: float(n), [3, 10]) == [3, 7]
    assert ns.balanced_split(10, lambda k, n: float(n), [10, 10]) == [5, 5]
    with pytest.raises(SplitError):
        ns.balanced_split(10, lambda k, n: float(n), [3, 6])


def test_the_log_names_each_node_its_layers_and_the_balance():
    nodes = [NodeSpec(0, (1.0,), 0.0, 0.0), NodeSpec(1, (2.0,), 0.0, 0.0, memory=2 * GIB)]
    text = describe([20, 10], nodes, WEIGHTS)
    assert "node 0: layer 1.00 ms, memory not limited: layers [20]" in text
    assert "node 1: layer 2.00 ms, 2.00 GiB" in text and "layers [10]" in text
    assert "predicted stage times [20.0, 20.0] ms; 0.0% lost" in text


def _meta(node: int, memory: int | None = 2**40, cpus: int = 1, model: str = "cpu x", split: str = "default") -> dict:
    hw = {"device": "cpu", "model": model, "cpus": cpus, "threads": 1, "ranks": 1, "memory": memory}
    return {"node": node, "hardware": hw, "split": split}


def test_nodes_measure_themselves_only_when_asked_or_when_they_differ(smollm2_dir):
    """As node 0 was told: every node decides alike from what all published."""
    cfg = EngineConfig(model=str(smollm2_dir), pp_size=2, nnodes=2, dist_init_addr="127.0.0.1:1",
                       kv_cache_memory="64M")  # fmt: skip
    spec = ModelSpec.resolve(cfg)
    default = default_partition(spec.config.num_layers, 2, head_layers(spec.config))
    alike = [_meta(0), _meta(1)]
    assert why_measure(cfg, spec, alike, default) is None  # identical nodes: today's split
    assert "node 1 differs" in why_measure(cfg, spec, [_meta(0), _meta(1, cpus=4)], default)
    assert "node 1 differs" in why_measure(cfg, spec, [_meta(0), _meta(1, model="cpu y")], default)
    given = [_meta(0, split="given"), _meta(1, cpus=4)]
    assert why_measure(cfg, spec, given, default) is None  # node 0 was given a split
    short = [_meta(0), _meta(1, memory=100 * 2**20)]  # 100 MiB: not the 64 MiB KV and 13 layers' weights
    assert "node 1 has 0.10 GiB" in why_measure(cfg, spec, short, default)
    auto = [_meta(0, split="auto"), _meta(1)]
    assert why_measure(cfg, spec, auto, default) == "--pp-layer-partition auto"
    assert why_measure(cfg, spec, [_meta(0), _meta(1, split="auto")], default) is None  # node 0's word counts
    assert split_mode(cfg) == "default" and split_mode(replace(cfg, pp_layer_partition="auto")) == "auto"
    assert split_mode(replace(cfg, pp_layer_partition="20,10")) == "given"


def test_a_stage_is_priced_by_its_weights_and_kv(smollm2_dir):
    cfg = EngineConfig(model=str(smollm2_dir), pp_size=2, kv_cache_memory="64M", dtype="float32")
    spec = ModelSpec.resolve(cfg)
    b = stage_bytes(cfg, spec)
    m = spec.config
    assert b.first == m.vocab_size * m.hidden_size * 4 and b.kv_fixed == 64 * 2**20 and b.kv_layer == 0
    # SmolLM2 in float32: 30 layers of ~3.5M parameters and a 28M-parameter embedding, ~0.5 GiB in all
    assert 0.45 * GIB < 30 * b.layer + b.first < 0.55 * GIB
    frac = stage_bytes(EngineConfig(model=str(smollm2_dir), pp_size=2, kv_cache_memory="0.3", dtype="float32"), spec)
    assert frac.kv_fixed == 0 and frac.kv_layer == m.kv_bytes_per_token_per_layer * 4 * spec.context_len


def test_the_cgroup_limit_is_read_where_there_is_one(tmp_path):
    group = tmp_path / "sys" / "job"
    group.mkdir(parents=True)
    (group / "memory.max").write_text("1073741824\n")
    (group / "memory.current").write_text("268435456\n")
    assert _cgroup_room(tmp_path / "sys", "/job") == 768 * 2**20
    (group / "memory.max").write_text("max\n")
    assert _cgroup_room(tmp_path / "sys", "/job") is None


def test_the_planner_prints_the_split_and_each_nodes_launch_line(capsys):
    from ringsched import plan

    argv = ["--model", "smollm2-135m-instruct", "--max-model-len", "2048", "--dist-init-addr", "10.0.0.1:29500"]
    assert plan.main([*argv, "--node", "speed=1", "--node", "speed=0.5,memory=300M"]) == 0
    out = capsys.readouterr().out
    assert "node 0: layer 1.00 ms, memory not limited: layers [23]" in out and "layers [7]" in out
    launches = [ln for ln in out.splitlines() if ln.startswith("python -m ringsched.launch")]
    assert len(launches) == 2 and all("--pp-size 2 --pp-layer-partition 23,7" in ln for ln in launches)
    assert "--node-rank 1 --dist-init-addr 10.0.0.1:29500" in launches[1]
    # as the launcher measures: layer_ms from a node's log; two stages a node
    assert plan.main([*argv, "--node", "layer_ms=30,stages=2", "--node", "layer_ms=60,stages=2"]) == 0
    assert "--pp-size 4 --pp-layer-partition" in capsys.readouterr().out
    assert plan.main([*argv, "--node", "speed=1,memory=100M", "--node", "speed=1,memory=100M"]) == 2
    err = capsys.readouterr().err
    assert "cannot hold" in err and "node 0" in err and "node 1" in err and "short" in err
    assert plan.main([*argv, "--node", "fast=1"]) == 2
    assert "speed=S or layer_ms=T" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        plan.main(["--model", "smollm2-135m-instruct"])  # neither GPUs nor nodes
    assert "--gpu" in capsys.readouterr().err
