"""A replay on a fresh last stage (issue 47): a structured request's grammar first consumes the outputs the request
arrived with, then masks; one sampled here all along (preempted and recomputed included) is moved on only by the
tokens drawn here."""

from __future__ import annotations

from concurrent.futures import Future

import torch

from ringsched.comm.messages import BatchPlan, NewRequest, PlanEntry
from ringsched.sampling.params import SamplingParams
from ringsched.stage.sampler_state import FAILED, SamplerState

PROMPT, VOCAB = [5, 6, 7], 16


class RecordingConstraint:
    """Admits only `expected[i]` after `i` consumed tokens; records what it consumed."""

    def __init__(self, expected: list[int]) -> None:
        self.expected, self.consumed = expected, []

    def allowed(self) -> torch.Tensor:
        mask = torch.zeros(VOCAB, dtype=torch.bool)
        mask[self.expected[len(self.consumed)]] = True
        return mask

    def advance(self, token: int) -> None:
        if token != self.expected[len(self.consumed)]:
            raise ValueError(f"token {token} refused")
        self.consumed.append(token)


class FakeGrammars:
    def __init__(self, expected: list[int]) -> None:
        self.expected = expected
        self.built: list[RecordingConstraint] = []

    def build(self, grammar: str, after: tuple[int, ...] = ()) -> Future:
        c = RecordingConstraint(self.expected)
        self.built.append(c)
        f: Future = Future()
        f.set_result(c)
        return f


def _step(state: SamplerState, start: int, ids: list[int], announce=()) -> int:
    plan = BatchPlan(0, 0, entries=[PlanEntry("r", start, ids, True)], announce=list(announce))
    state.apply(plan)
    return state.sample(plan, torch.zeros(1, VOCAB))[1].item()


def test_a_replayed_grammar_consumes_the_delivered_outputs_before_it_masks():
    expected = [9, 3, 11, 4, 8]
    announce = [NewRequest("r", [], SamplingParams(temperature=0, grammar="g").to_dict(), len(PROMPT))]
    grammars = FakeGrammars(expected)
    state = SamplerState(torch.device("cpu"), grammars=grammars)
    assert _step(state, 0, PROMPT + expected[:2], announce) == expected[2]  # a replay with 2 delivered
    assert grammars.built[0].consumed == expected[:3]
    assert _step(state, len(PROMPT) + 2, [expected[2]]) == expected[3]  # then plain decodes
    assert grammars.built[0].consumed == expected[:4]


def test_a_grammar_sampled_here_all_along_is_not_fed_its_outputs_again():
    expected = [9, 3, 11, 4, 8]
    announce = [NewRequest("r", [], SamplingParams(temperature=0, grammar="g").to_dict(), len(PROMPT))]
    grammars = FakeGrammars(expected)
    state = SamplerState(torch.device("cpu"), grammars=grammars)
    assert _step(state, 0, PROMPT, announce) == 9
    assert _step(state, len(PROMPT), [9]) == 3
    assert _step(state, 0, PROMPT + [9, 3]) == 11  # recomputed after a preemption: the grammar goes on
    assert grammars.built[0].consumed == [9, 3, 11]


def test_a_replay_whose_outputs_the_grammar_refuses_fails_alone():
    announce = [NewRequest("r", [], SamplingParams(temperature=0, grammar="g").to_dict(), len(PROMPT))]
    state = SamplerState(torch.device("cpu"), grammars=FakeGrammars([9, 3, 11]))
    assert _step(state, 0, PROMPT + [1], announce) == FAILED
