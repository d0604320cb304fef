"""How many drafts a request verifies (`speculative/adaptive.py`): as many as raise expected tokens per second, so
one request on a step whose cost hardly grows with its rows drafts fully, a compute-bound batch not at all, and a
request whose drafts are rarely kept stops drafting; acceptance and step costs are learned as steps run."""

from __future__ import annotations

import pytest

from ringsched.speculative.adaptive import PRIOR_RATE, STALE_STEPS, Acceptance, StepCosts, choose


def expected(rate: float, k: int) -> float:
    return sum(rate**j for j in range(k + 1))


def flat_then_linear(rows: int) -> float:  # a CPU decode: streaming the weights dominates up to ~8 rows
    return 1.0 + 0.02 * rows if rows <= 8 else 1.16 * rows / 8


@pytest.mark.parametrize("rate", [0.05, 0.3, 0.6, 0.9])
@pytest.mark.parametrize("cost", [flat_then_linear, lambda r: 1.0 + 0.3 * (r - 1), lambda r: float(r)])
def test_one_request_drafts_what_maximises_tokens_per_second(rate, cost):
    (k,) = choose([rate], [6], cost)
    best = max(range(7), key=lambda j: (expected(rate, j) / cost(1 + j), -j))
    assert expected(rate, k) / cost(1 + k) == pytest.approx(expected(rate, best) / cost(1 + best))


def test_where_rows_are_nearly_free_one_request_drafts_fully_and_a_busy_batch_not_at_all():
    assert choose([0.6], [5], flat_then_linear) == [5]
    assert choose([0.6] * 64, [5] * 64, flat_then_linear) == [0] * 64
    assert choose([0.6] * 64, [5] * 64, lambda r: float(r), other_rows=100) == [0] * 64
    assert choose([0.9], [0], flat_then_linear) == [0]  # no draft to verify


def test_in_a_small_batch_the_likeliest_drafts_go_first():
    k = choose([0.95, 0.2, 0.7], [4, 4, 4], lambda r: 1.0 + 0.1 * r)
    assert k[0] >= k[2] >= k[1] and k[0] > 0
    a, b = choose([0.8, 0.8], [3, 3], flat_then_linear)
    assert a >= 1 and b >= 1 and abs(a - b) <= 1  # alike requests share the cheap rows


def test_acceptance_follows_what_is_kept():
    a = Acceptance()
    assert a.rate == PRIOR_RATE
    for _ in range(40):
        a.record(proposed=4, kept=4)
    assert a.rate > 0.95
    for _ in range(40):
        a.record(proposed=4, kept=0)
    assert a.rate < 0.05
    a.record(proposed=0, kept=0)  # a step without drafts says nothing
    assert a.rate < 0.05


def test_step_costs_are_learned_per_bucket_and_guessed_optimistically_beyond():
    costs = StepCosts()
    assert costs(1) == costs(50) == 1.0  # nothing measured: try
    costs.record(1, 0.010)
    costs.record(8, 0.012)
    assert costs(1) == pytest.approx(0.010) and costs(8) == pytest.approx(0.012)
    assert costs(4) == pytest.approx(0.010 + 3 / 7 * 0.002)  # between buckets: linear
    assert costs(16) == pytest.approx(0.012)  # up to twice the largest measured: as it
    assert costs(64) == pytest.approx(0.012 * 64 / 16)  # then in proportion to the rows
    for _ in range(30):
        costs.record(8, 0.020)
    assert costs(8) == pytest.approx(0.020, rel=0.01)  # a decayed mean follows the machine
    costs.record(2000, 2.0)  # past the last bucket: scaled to it
    assert costs(1024) == pytest.approx(2.0 * 1024 / 2000)


def test_a_cost_that_once_kept_drafting_off_is_tried_again_once_stale():
    costs = StepCosts()
    costs.record(1, 0.010)
    costs.record(2, 0.050)  # one noisy step of two rows
    assert choose([0.9], [4], costs) == [0]  # drafting looks 5x dearer: off, and two-row steps are not measured
    for _ in range(STALE_STEPS + 1):
        costs.record(1, 0.010)  # only one-row steps since: the two-row bucket goes stale
    assert costs(2) == pytest.approx(0.010)  # guessed as the rows below it, so drafting is tried again
    assert choose([0.9], [4], costs)[0] >= 1


def test_a_noisy_bucket_does_not_hide_a_cheaper_step_further_on():
    costs = {1: 1.0, 2: 1.6, 3: 1.05, 4: 1.06, 5: 1.07}  # two rows measured slow; more rows are not
    assert choose([0.9], [4], lambda r: costs[r]) == [4]


def test_without_adaptation_a_busy_batch_still_drafts_all_it_has():
    """`"adaptive": false`: every decode takes what its drafter proposes, whatever the step costs say."""
    from ringsched.comm.messages import BatchPlan, PlanEntry
    from ringsched.kv.cache import BlockTable
    from ringsched.sampling.params import SamplingParams
    from ringsched.scheduler.request import Request
    from ringsched.scheduler.speculation import Speculator
    from ringsched.speculative.config import SpeculativeConfig

    for adaptive, want in ((True, 0), (False, 3)):
        spec = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                        "adaptive": adaptive})  # fmt: skip
        blocks = BlockTable(64, 16)
        sp = Speculator(spec, blocks, 1000)
        for rows in range(1, 40):
            sp.step_took(rows, float(rows))  # every row costs as much as the first: drafts never pay
        requests, plan = {}, BatchPlan(slot=0, seq=0)
        for i in range(8):
            r = Request(f"r{i}", [5, 6, 7, 5, 6, 7, 5, 6], SamplingParams(max_tokens=20), i, [7])
            requests[r.rid] = r
            plan.entries.append(PlanEntry(r.rid, 9 - 1, [7], True, **blocks.grow(r.rid, 9)))
        sp.extend(plan, requests)
        assert [e.drafts for e in plan.entries] == [want] * 8, adaptive
