"""`--pp-layer-partition auto`: the min-max choice on given costs, the measurement on a real micro-batch, the
launcher resolving it before the stages start, and other nodes taking node 0's decision."""

from __future__ import annotations

import itertools
import logging
import os
import threading

import pytest
import torch

from ringsched.config import ConfigError, EngineConfig
from ringsched.layout.partition import ENV_OVERRIDE
from ringsched.process.partition_auto import BatchShape, StageCosts, balance_loss, best_partition, choose_partition
from ringsched.weights.model_config import ModelConfig

pytestmark = pytest.mark.slow  # real model or several processes: the full suite's

SHAPE = BatchShape(decodes=64, prefill_tokens=64, context=256)


def brute_force(num_layers: int, pp: int, costs: StageCosts) -> float:
    best = float("inf")
    for cut in itertools.combinations(range(1, num_layers), pp - 1):
        bounds = (0, *cut, num_layers)
        counts = [bounds[i + 1] - bounds[i] for i in range(pp)]
        best = min(best, max(costs.stage_ms(counts)))
    return best


@pytest.mark.parametrize("head_layers", [0.0, 2.0, 8.0, 40.0])
@pytest.mark.parametrize("layers,pp", [(30, 2), (30, 3), (12, 4), (7, 7)])
def test_best_partition_minimises_the_slowest_stage(layers, pp, head_layers):
    costs = StageCosts.uniform(layer_ms=1.0, embed_ms=0.3, head_ms=head_layers, shape=SHAPE, pp=pp)
    counts = best_partition(layers, pp, costs)
    assert sum(counts) == layers and len(counts) == pp and min(counts) >= 1
    assert max(costs.stage_ms(counts)) == pytest.approx(brute_force(layers, pp, costs))


def test_head_weight_moves_layers_to_the_front_and_ties_go_even():
    assert best_partition(30, 2, StageCosts.uniform(1.0, 0.0, 0.0, SHAPE, 2)) == [15, 15]
    assert best_partition(30, 2, StageCosts.uniform(1.0, 0.0, 8.0, SHAPE, 2)) == [19, 11]  # the 8-layer head
    assert best_partition(30, 3, StageCosts.uniform(1.0, 0.0, 3.0, SHAPE, 3)) == [11, 11, 8]
    # A stage on slower cores gets fewer layers.
    assert best_partition(30, 2, StageCosts((1.25, 1.0), 0.0, 0.0, SHAPE)) == [13, 17]
    # A split the head makes lopsided reports its loss against a perfect balance.
    ms = StageCosts.uniform(1.0, 0.0, 8.0, SHAPE, 2).stage_ms([19, 11])
    assert ms == [19.0, 19.0] and balance_loss(ms) == 0.0
    assert balance_loss([10.0, 5.0]) == pytest.approx(0.25)


def test_batch_shape_from_the_workload():
    # 128 + 128: as many prefill tokens as decodes per step, decodes at context 128 + 64.
    s = BatchShape.for_workload(64, 512, max_len=8192, input_len=128, output_len=128)
    assert (s.decodes, s.prefill_tokens, s.context, s.tokens, s.sample_rows) == (64, 64, 192, 128, 65)
    # Short prompts, longer outputs: fewer prefill tokens per step, a shorter context.
    s = BatchShape.for_workload(32, 512, max_len=8192, input_len=32, output_len=64)
    assert (s.decodes, s.prefill_tokens, s.context) == (32, 16, 64)
    # Chunked prefill caps the prefill tokens, the model's length the context.
    s = BatchShape.for_workload(64, 48, max_len=100, input_len=512, output_len=64)
    assert (s.prefill_tokens, s.context) == (48, 99)
    with pytest.raises(ValueError):
        BatchShape(0, 0, 10)


def test_measured_costs_grow_with_the_work(tiny_llama_dir):
    """Costs come from timing real layers: a bigger batch costs more, and the head scales with the vocab."""
    mcfg = ModelConfig.from_dir(tiny_llama_dir)
    small, big = BatchShape(2, 0, 16), BatchShape(64, 256, 64)
    from ringsched.process.partition_auto import CostProbe

    # The least of nine measurements each, taken in turns: the small probe's seven repeats take ~3 ms in all,
    # and a busy moment of the host (CI) once made three of them in a row 3.8 ms against the big probe's 1.1.
    p_small = CostProbe(mcfg, small, torch.float32, torch.device("cpu"))
    p_big = CostProbe(mcfg, big, torch.float32, torch.device("cpu"))
    pairs = [(p_small.measure(), p_big.measure()) for _ in range(9)]
    c_small = min((s for s, _ in pairs), key=lambda c: c.layer_ms[0])
    c_big = min((b for _, b in pairs), key=lambda c: c.layer_ms[0])
    assert 0 < c_small.layer_ms[0] < c_big.layer_ms[0]
    assert c_small.head_ms > 0 and c_small.embed_ms > 0


def test_choose_partition_logs_the_decision_and_restores_threads(tiny_llama_dir, caplog):
    mcfg = ModelConfig.from_dir(tiny_llama_dir)
    threads = torch.get_num_threads()
    cpus = sorted(os.sched_getaffinity(0))
    with caplog.at_level(logging.INFO, logger="ringsched.process.partition_auto"):
        counts, costs = choose_partition(
            mcfg, 2, SHAPE, torch.float32, torch.device("cpu"), threads=1, stage_cpus=[cpus[:1], cpus[-1:]]
        )
    assert sum(counts) == mcfg.num_layers and len(counts) == 2 and len(costs.layer_ms) == 2
    assert os.sched_getaffinity(0) == set(cpus)
    assert counts == best_partition(mcfg.num_layers, 2, costs)
    assert torch.get_num_threads() == threads
    text = caplog.text
    assert "auto: " + ",".join(map(str, counts)) in text and "lost against a perfect balance" in text


def test_auto_in_the_config_and_the_environment(monkeypatch):
    cfg = EngineConfig(pp_size=2, pp_layer_partition="auto")
    assert cfg.auto_partition
    cfg.check_partition(30)  # fine: the launcher decides
    with pytest.raises(ConfigError, match="auto"):
        cfg.partition(30)
    monkeypatch.setenv(ENV_OVERRIDE, "auto")
    assert EngineConfig(pp_size=2).auto_partition
    assert not EngineConfig(pp_size=2, pp_layer_partition="16,14").auto_partition


def test_other_nodes_take_node_0s_decision(tiny_llama_dir):
    """Node 0 publishes its measured split; node 1, started with `auto`, adopts it; an explicit different
    split on node 1 is still refused."""
    from ringsched.process.ports import free_port
    from ringsched.process.rendezvous import Rendezvous, RendezvousError

    def cfg(rank: int, port: int) -> EngineConfig:
        return EngineConfig(
            model=str(tiny_llama_dir), pp_size=2, nnodes=2, node_rank=rank, dist_init_addr=f"127.0.0.1:{port}",
            host_ip="127.0.0.1", dist_timeout=20, pp_layer_partition="auto",
        )  # fmt: skip

    def meet(node1_partition: list[int] | None) -> tuple[list, list]:
        port = free_port()
        head = Rendezvous(cfg(0, port), "tiny", str(tiny_llama_dir), [4, 2])
        results: dict[int, object] = {}

        def join(r: Rendezvous, rank: int) -> None:
            try:
                r.join()
                results[rank] = r.partition
            except RendezvousError as e:
                results[rank] = e

        other = Rendezvous(cfg(1, port), "tiny", str(tiny_llama_dir), node1_partition)
        threads = [threading.Thread(target=join, args=(r, i)) for i, r in enumerate((head, other))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for r in (other, head):
            r.close()
        return results[0], results[1]

    assert meet(None) == ([4, 2], [4, 2])
    r0, r1 = meet([2, 2])
    assert isinstance(r1, RendezvousError) and "partition" in str(r1)


def test_engine_with_auto_runs_the_measured_split(tiny_llama_dir, caplog):
    """End to end: the launcher measures, the stages load the split it chose, and the tokens are PP=1's."""
    from ringsched.engine import Engine
    from ringsched.sampling.params import SamplingParams

    prompts = [[5 + i, 17, 99, 3 * i + 1] for i in range(6)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    with Engine(str(tiny_llama_dir), pp_size=1, threads_per_stage=1, kv_cache_memory="16M") as llm:
        want = [o.token_ids for o in llm.generate(prompts, params)]
    with caplog.at_level(logging.INFO, logger="ringsched.process.partition_auto"):
        with Engine(str(tiny_llama_dir), pp_size=2, threads_per_stage=1, kv_cache_memory="16M",
                    pp_layer_partition="auto") as llm:  # fmt: skip
            got = [o.token_ids for o in llm.generate(prompts, params)]
            decided = [int(c) for c in llm.supervisor.cfg.pp_layer_partition.split(",")]
            layers = [llm.supervisor.info[r]["layers"] for r in range(2)]
    assert got == want
    assert sum(decided) == 6 and layers == [[0, decided[0]], [decided[0], 6]]
    assert "--pp-layer-partition auto: " + ",".join(map(str, decided)) in caplog.text


def test_cores_count_as_unequal_only_when_every_round_says_so():
    from ringsched.process.partition_auto import cores_layer_ms

    # Overlapping rounds (one noisy 65 ms round on core 0): the cores share the pooled median.
    assert cores_layer_ms([[51.0, 65.0, 53.0], [51.5, 52.0, 54.0]]) == (52.5, 52.5)
    # Core 0 slower in every round: each core keeps its own median.
    assert cores_layer_ms([[60.0, 61.0, 62.0], [50.0, 52.0, 51.0]]) == (61.0, 51.0)
    # Disjoint but within 10% (a neighbour on one core for the probe's few seconds): still one pooled figure.
    assert cores_layer_ms([[52.0, 53.0, 54.0], [55.0, 56.0, 55.5]]) == (54.5, 54.5)


def test_probe_spans_more_than_the_cache_but_at_most_a_stage(tiny_llama_dir):
    from ringsched.process.partition_auto import PROBE_BYTES, probe_layers

    mcfg = ModelConfig.from_dir(tiny_llama_dir)
    shape = BatchShape(64, 64, 256)
    assert probe_layers(mcfg, shape, torch.float32, stage_layers=3) <= 3
    n = probe_layers(mcfg, shape, torch.float32, stage_layers=10**6)
    per_layer_kv = (64 * 256 + 64) * mcfg.kv_bytes_per_token_per_layer * 4
    assert n * per_layer_kv < PROBE_BYTES + per_layer_kv * 2 or n == 1
    assert n > 1  # a tiny layer: many of them fill the span


def test_choose_partition_apart_measures_in_a_child(tiny_llama_dir):
    """What the launcher runs for a GPU: the same measurement in a spawned child, so the launcher's process never
    initialises CUDA (checked here only as far as a CPU machine can: the answer comes back whole)."""
    from ringsched.process.partition_auto import choose_partition_apart

    mcfg = ModelConfig.from_dir(tiny_llama_dir)
    counts, costs = choose_partition_apart(mcfg, 2, SHAPE, torch.float32, torch.device("cpu"), threads=1)
    assert sum(counts) == mcfg.num_layers and len(counts) == 2
    assert counts == best_partition(mcfg.num_layers, 2, costs)
    assert not torch.cuda.is_initialized()


def test_each_stage_is_timed_on_its_own_device(tiny_llama_dir):
    """A node's GPUs need not be alike: one probe per device, each stage timed on its own (two CPU devices by name
    here, as far as a CPU machine can)."""
    from ringsched.process.partition_auto import measure_stages

    mcfg = ModelConfig.from_dir(tiny_llama_dir)
    devices = [torch.device("cpu"), torch.device("cpu", 0)]
    costs = measure_stages(mcfg, 2, SHAPE, torch.float32, devices, threads=1, rounds=1)
    assert len(costs.layer_ms) == 2 and all(ms > 0 for ms in costs.layer_ms) and costs.head_ms > 0
