"""The flexible cut of a PP=2 ring (`--pp-flex-layers`): the ranges, the cut chooser and the K/V mirror.
The ring end to end with a moving cut is in test_ring.py."""

from collections.abc import Iterator

import pytest
import torch

from ringsched.config import ConfigError, EngineConfig
from ringsched.layout.flex import WARMUP_OBSERVATIONS, CutChooser, FlexBoundary
from ringsched.stage.flex_ring import gather_kv, scatter_kv


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
    from ringsched.layout.rank import StageInfo
    from ringsched.stage.flex_ring import FlexRing

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


class FakeProgressIn:
    """Stage 1's StageProgress messages as stage 0's Puller hands them out."""

    def __init__(self) -> None:
        self.queued: list = []

    def drain(self) -> list:
        out, self.queued = self.queued, []
        return out


def ready_rings(b: FlexBoundary):
    from ringsched.layout.rank import StageInfo
    from ringsched.stage.flex_ring import FlexRing

    cpu = torch.device("cpu")
    caches0 = [(torch.arange(8.0).view(8, 1, 1).repeat(1, 1, 2) + i, torch.zeros(8, 1, 2)) for i in range(b.hi)]
    caches1 = [(torch.zeros(8, 1, 2), torch.zeros(8, 1, 2)) for _ in range(30 - b.lo)]
    progress_in, sent = FakeProgressIn(), []
    s0 = FlexRing(b, StageInfo(0, 2, 0, b.hi), caches0, cpu, "ready", progress_in=progress_in)
    out = type("FakePusher", (), {"send": staticmethod(sent.append)})()
    s1 = FlexRing(b, StageInfo(1, 2, b.lo, 30), caches1, cpu, "ready", progress_out=out)
    return s0, s1, progress_in, sent, caches0, caches1


def test_ready_policy_cuts_when_stage_1_is_ready_or_about_to_be():
    """`--pp-flex-policy ready`: stage 0 runs the shared layers until stage 1 has finished the micro-batch before,
    or expects to within half a layer; the cut is not in the plan."""
    import time

    from ringsched.comm.messages import BatchPlan, PlanEntry, StageProgress

    b = FlexBoundary(30, 15, 3)
    s0, _, progress_in, _, _, _ = ready_rings(b)

    def run(seq: int, at_layer: dict) -> tuple[list[int], BatchPlan]:
        plan = BatchPlan(seq % 2, seq, [PlanEntry("a", 0, [1], True)])
        s0.choose(plan)
        assert plan.cut == -1  # decided while the micro-batch runs
        ran = []
        for i in s0.layers(plan):
            ran.append(i)
            time.sleep(0.002)  # a layer's time: 2 ms
            progress_in.queued += at_layer.get(i, [])
        return ran, plan

    ran, plan = run(0, {})  # nothing before micro-batch 0: stage 1 is free at once
    assert ran == list(range(b.lo)) and plan.cut == b.lo
    ran, plan = run(1, {13: [StageProgress(0, time.time() + 60)], 14: [StageProgress(0, 0.0, done=True)]})
    assert ran == list(range(15)) and plan.cut == 15  # done during layer 14
    ran, plan = run(2, {1: [StageProgress(1, time.time() + 60)]})  # never done: the last shared layer is ours
    assert ran == list(range(b.hi)) and plan.cut == b.hi
    # Expected done within half a layer (1 ms) of the cut at 15: cut there rather than keep stage 1 waiting.
    soon = time.time() + 15 * 0.002 + 0.0005
    ran, plan = run(3, {1: [StageProgress(2, time.time() + 60)], 14: [StageProgress(2, soon)]})
    assert plan.cut == 15, ran
    # A forecast for another micro-batch says nothing about this one.
    progress_in.queued.append(StageProgress(3, 0.0))
    ran, plan = run(5, {16: [StageProgress(4, 0.0, done=True)]})
    assert plan.cut == 17


def test_ready_policy_stage_1_reads_the_cut_and_reports_progress():
    import time

    from ringsched.comm.messages import BatchPlan, PlanEntry, StageProgress

    b = FlexBoundary(30, 15, 3)
    s0, s1, progress_in, sent, caches0, caches1 = ready_rings(b)
    slots = torch.tensor([1, 5])
    mb = BatchPlan(0, 0, [PlanEntry("a", 0, [1, 2], True)])
    assert list(s0.layers(mb)) == list(range(b.lo)) and mb.cut == b.lo  # nothing before it: stage 1 is free
    mb = BatchPlan(1, 1, [PlanEntry("a", 0, [1, 2], True)])
    for i in s0.layers(mb):
        if i == 15:
            progress_in.queued.append(StageProgress(0, 0.0, done=True))
    assert mb.cut == 16
    rows = s0.mirror_out(mb, slots)
    theirs = BatchPlan(1, 1, [PlanEntry("a", 0, [1, 2], True)])  # as stage 1 decodes it: cut -1
    s1.take_cut(theirs, rows)
    assert theirs.cut == 16
    s1.mirror_in(theirs, rows, slots)
    for i in b.mirrored(0, 16):
        assert torch.equal(caches1[i - b.lo][0][slots], caches0[i][0][slots])
    assert list(s1.layers(theirs)) == list(range(16, 30))
    # No forecast before the first layer is timed; then one before each layer, not done.
    assert [m.seq for m in sent] == [1] * 13 and not any(m.done for m in sent)
    s1.head_took(2, 0.004)
    s1.done(theirs)
    assert sent[-1].seq == 1 and sent[-1].done
    # The next micro-batch: a forecast before each layer, finishing at the end of its layers plus the head.
    nxt = BatchPlan(0, 2, [PlanEntry("a", 2, [3], True), PlanEntry("b", 0, [4], True)], cut=18)
    sent.clear()
    t0 = time.time()
    for _ in s1.layers(nxt):
        time.sleep(0.002)
    assert [m.seq for m in sent] == [2] * 12  # the first from the micro-batch before's pace
    last = sent[-1].finish_at - t0  # one layer left at ~2 ms a layer, plus 2 rows of head at 2 ms each
    assert 0.022 + 0.002 + 0.004 - 0.003 < last < 0.022 + 0.002 + 0.004 + 0.02, last
    with pytest.raises(RuntimeError, match="the plan cuts at layer 17, the proxy at 16"):
        s1.take_cut(BatchPlan(0, 4, [], cut=17), rows)


def test_ready_policy_cuts_a_one_call_step_at_the_base_cut():
    """A step the one-call decode layers can run (a few decodes) is cut at the base cut before its layers run, and
    both stages get a range (so the model takes the one call); stage 1 sends no forecast for it."""
    from ringsched.comm.messages import BatchPlan, PlanEntry, StageProgress

    b = FlexBoundary(30, 15, 3)
    s0, s1, progress_in, sent, _, _ = ready_rings(b)
    plan = BatchPlan(0, 0, [PlanEntry("a", 4, [1], True)])
    progress_in.queued.append(StageProgress(0, 0.0, done=True))  # stage 1 free: an iterator would cut at lo
    assert s0.layers(plan, one_call=True) == range(0, 15) and plan.cut == 15
    theirs = BatchPlan(0, 0, [PlanEntry("a", 4, [1], True)], cut=15)
    assert s1.layers(theirs, one_call=True) == range(15, 30) and not sent
    assert isinstance(s1.layers(theirs), Iterator)  # a step that does not take the one call: forecasts


def test_a_chunk_is_cut_no_later_than_the_in_flight_chunks_it_reads():
    """Stage 0 holds an in-flight micro-batch's shared-layer KV up to its cut only (the rest comes back with its
    output): a plan that reads it (`plan.reads`, a prompt's next chunk) is cut no later, by every policy."""
    from ringsched.comm.messages import BatchPlan, PlanEntry
    from ringsched.layout.flex import CYCLE
    from ringsched.layout.rank import StageInfo
    from ringsched.stage.flex_ring import FlexRing

    b = FlexBoundary(30, 15, 3)
    s0, _, _, _, _, _ = ready_rings(b)
    first = BatchPlan(0, 0, [PlanEntry("a", 0, [1] * 8, False)])
    assert list(s0.layers(first)) == list(range(b.lo)) and first.cut == b.lo  # stage 1 free: cut at lo
    s0.computed(first, 0.01, torch.tensor([0]), [])
    nxt = BatchPlan(1, 1, [PlanEntry("a", 8, [1] * 8, False)], reads=[0])
    assert list(s0.layers(nxt)) == list(range(b.lo)) and nxt.cut == b.lo  # stage 1 never done: hi without it
    caches = [(torch.zeros(8, 1, 2), torch.zeros(8, 1, 2)) for _ in range(b.hi)]
    ring = FlexRing(b, StageInfo(0, 2, 0, b.hi), caches, torch.device("cpu"), CYCLE)
    cuts = []
    for seq in range(2 * len(range(b.lo, b.hi + 1))):
        plan = BatchPlan(seq % 2, seq, [PlanEntry("a", 8 * seq, [1] * 8, False)], reads=[seq - 1] if seq else [])
        ring.choose(plan)
        ring.computed(plan, 0.01, torch.tensor([0]), [])  # never back: each reads the one before, in flight
        cuts.append(plan.cut)
    assert cuts == sorted(cuts, reverse=True) and cuts[0] > b.lo and cuts[-1] == b.lo, cuts
