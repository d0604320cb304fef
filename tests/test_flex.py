"""The flexible cut of a PP=2 ring (`--pp-flex-layers`): the ranges, the cut chooser and the K/V mirror.
The ring end to end with a moving cut is in test_ring.py."""

import pytest
import torch

from ringsched.config import ConfigError, EngineConfig
from ringsched.flex import WARMUP_OBSERVATIONS, CutChooser, FlexBoundary, gather_kv, scatter_kv


def test_ranges():
    b = FlexBoundary(num_layers=30, base=17, k=2)
    assert (b.lo, b.hi) == (15, 19)
    assert b.held(0) == (0, 19) and b.held(1) == (15, 30)
    assert b.run_range(0, 16) == range(0, 16) and b.run_range(1, 16) == range(16, 30)
    assert b.mirrored(0, 16) == range(15, 16) and b.mirrored(1, 16) == range(16, 19)
    assert b.mirrored(0, 15) == range(15, 15) and b.mirrored(1, 19) == range(19, 19)


def test_a_stage_keeps_a_layer_of_its_own():
    with pytest.raises(ValueError, match="at most 2"):
        FlexBoundary(num_layers=30, base=3, k=3)
    FlexBoundary(num_layers=30, base=3, k=2)


def test_config_errors_name_the_flag():
    with pytest.raises(ConfigError, match="--pp-flex-layers.*--pp-size 2"):
        EngineConfig(pp_size=3, pp_flex_layers=1)
    with pytest.raises(ConfigError, match="--pp-flex-layers must be >= 0"):
        EngineConfig(pp_size=2, pp_flex_layers=-1)
    with pytest.raises(ConfigError, match="--pp-flex-policy"):
        EngineConfig(pp_size=2, pp_flex_layers=1, pp_flex_policy="random")
    cfg = EngineConfig(pp_size=2, pp_flex_layers=15)
    with pytest.raises(ConfigError, match="--pp-flex-layers 15.*at most 14"):
        cfg.check_partition(30)
    assert EngineConfig(pp_size=2, pp_flex_layers=2).flex_boundary(30, [15, 15]).hi == 17
    assert EngineConfig(pp_size=2).flex_boundary(30, [15, 15]) is None


def simulated(cut: int, tokens: int, samples: int, layers: int = 30) -> tuple[float, float]:
    """Stage times of a made-up machine: a layer costs 1 ms + 0.05 ms per token, the head 0.2 ms per row."""
    layer = 1e-3 + 5e-5 * tokens
    return cut * layer, (layers - cut) * layer + 2e-4 * samples


def best_cut(b: FlexBoundary, tokens: int, samples: int) -> int:
    def gap(c: int) -> float:
        s0, s1 = simulated(c, tokens, samples)
        return abs(s0 - s1)

    return min(range(b.lo, b.hi + 1), key=gap)


def test_chooser_learns_to_cut_prefill_and_decode_batches_differently():
    b = FlexBoundary(30, 16, 3)
    ch = CutChooser(b)
    shapes = [(128, 128), (512, 132), (300, 60), (64, 64), (512, 1)]
    assert ch.choose(512, 1) == 16  # no measurements yet: the partition's cut
    for i in range(40):
        tokens, samples = shapes[i % len(shapes)]
        cut = ch.choose(tokens, samples) if i >= WARMUP_OBSERVATIONS else b.base
        ch.observe(tokens, samples, cut, *simulated(cut, tokens, samples))
    decode, prefill = ch.predict(128 / 128), ch.predict(1 / 512)
    assert round(decode) == best_cut(b, 128, 128) and round(prefill) == best_cut(b, 512, 1)
    assert decode > prefill + 1  # the head weighs on stage 1 in decode batches: stage 0 takes more layers
    assert b.lo <= ch.choose(1, 1) <= b.hi and ch.choose(0, 0) == b.base
    # Cuts chosen in a row average to the fitted ideal (error diffusion), each within one of it.
    cuts = [ch.choose(128, 128) for _ in range(40)]
    assert abs(sum(cuts) / len(cuts) - decode) < 0.05 and all(abs(c - decode) < 1 for c in cuts)


def test_cycle_visits_every_cut():
    b = FlexBoundary(30, 15, 2)
    ch = CutChooser(b, "cycle")
    assert sorted({ch.choose(10, 1) for _ in range(10)}) == [13, 14, 15, 16, 17]
    with pytest.raises(ValueError, match="flex policy"):
        CutChooser(b, "sometimes")


def test_mirror_round_trip():
    def caches(n):
        return [(torch.zeros(64, 3, 4), torch.zeros(64, 3, 4)) for _ in range(n)]

    here, there = caches(5), caches(4)  # layers [0, 5) here and [2, 6) there: 2..4 shared
    for k, v in here:
        k.normal_()
        v.normal_()
    slots = torch.tensor([3, 9, 10, 40])
    rows = gather_kv(here, 0, range(2, 4), slots)
    assert len(rows) == 1 and rows[0].shape == (4, 4, 3, 4)  # K, V of two layers; four tokens
    assert gather_kv(here, 0, range(2, 2), slots) == []
    scatter_kv(there, 2, range(2, 4), slots, rows)
    for layer in (2, 3):
        for j in (0, 1):
            assert torch.equal(there[layer - 2][j][slots], here[layer][j][slots])
            assert not there[layer - 2][j][11:40].any()  # only those slots were written
    assert not there[2][0].any()  # layer 4 was not mirrored
    with pytest.raises(RuntimeError, match="2 shared layers, got 0"):
        scatter_kv(there, 2, range(2, 4), slots, [])
    scatter_kv(there, 2, range(2, 2), slots, [])  # nothing shared was run: nothing to write


def test_time_outside_the_model_counts_in_the_balance():
    """The ring's pace is each stage's whole time per micro-batch: a stage 0 that also spends time planning and
    delivering outputs gets fewer layers than compute alone would give it, and stage 1 reports its own."""
    from ringsched.comm.messages import BatchPlan, PlanEntry
    from ringsched.scheduler.flex_ring import FlexRing
    from ringsched.stage import StageInfo

    b, cpu = FlexBoundary(30, 15, 3), torch.device("cpu")

    def caches(n):
        return [(torch.zeros(8, 1, 2), torch.zeros(8, 1, 2)) for _ in range(n)]

    def learnt_cut(overhead0: float, overhead1: float) -> float:
        s0 = FlexRing(b, StageInfo(0, 2, 0, b.hi), caches(b.hi), cpu)
        s1 = FlexRing(b, StageInfo(1, 2, b.lo, 30), caches(30 - b.lo), cpu)
        slots = torch.tensor([1, 2])
        for seq in range(60):
            s0.note_overhead(overhead0)
            s1.note_overhead(overhead1)
            plan = BatchPlan(0, seq, [PlanEntry(str(i), 0, [1], True) for i in range(2)])
            s0.choose(plan)
            layer = 0.01  # compute: every layer costs the same on both stages; no head
            s0.sent(plan, plan.cut * layer, slots)
            rows = gather_kv(s1.caches, b.lo, b.mirrored(1, plan.cut), slots)
            s0.on_output(seq, s1.output_payload(torch.tensor([7, 7]), (30 - plan.cut) * layer, rows))
        return s0.chooser.predict(1.0)

    assert abs(learnt_cut(0.0, 0.0) - 15) < 0.3  # compute alone: the even cut
    # Stage 0 spends 40 ms per micro-batch outside the model (4 layers' time): it should run 2 layers fewer.
    assert abs(learnt_cut(0.04, 0.0) - 13) < 0.4
    assert abs(learnt_cut(0.0, 0.04) - 17) < 0.4  # and the other way round
