import math

import msgpack
import pytest
import torch

from ringsched.sampling.params import SamplingParams
from ringsched.sampling.sampler import apply_repetition_penalty, sample, uniform

RANDOM = SamplingParams(temperature=1.0)


def draw_many(logits_row: torch.Tensor, params: SamplingParams, n: int, seed: int = 0) -> torch.Tensor:
    """n draws of one row in one call: row i draws as the request's i-th output token would."""
    return sample(logits_row.expand(n, -1), [params] * n, [[] for _ in range(n)], [(seed, i) for i in range(n)])


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"max_tokens": 0}, r"max_tokens must be an int in \[1, 2\*\*63\), got 0"),
        ({"max_tokens": 2**63}, "max_tokens must be an int in"),
        ({"max_tokens": 2.5}, "max_tokens must be"),
        ({"temperature": -1}, "temperature must be >= 0, got -1.0"),
        ({"temperature": math.nan}, "temperature must be a finite number"),
        ({"temperature": 10**400}, "temperature must be a finite number, got an int of 1329 bits"),
        ({"temperature": "0.5"}, "temperature must be a finite number, got '0.5'"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0.0"),
        ({"top_p": 1.5}, "top_p must be in"),
        ({"top_k": -2}, r"top_k must be -1 or 0 .* or an int in \[1, 2\*\*63\), got -2"),
        ({"top_k": 2**70}, "top_k must be -1 or 0"),
        ({"min_p": -0.1}, r"min_p must be in \[0, 1\]"),
        ({"min_p": 1.1}, "min_p must be in"),
        ({"seed": 2**64}, "seed must be None or an int"),
        ({"seed": "7"}, "seed must be None or an int"),
        ({"stop_token_ids": [1, -2]}, r"stop_token_ids must be a list of ints in \[0, 2\*\*63\)"),
        ({"stop_token_ids": [2**64]}, "stop_token_ids must be a list of ints in"),
        ({"stop_token_ids": list(range(257))}, "stop_token_ids must be at most 256 ids, got 257"),
        ({"stop_token_ids": 5}, "stop_token_ids must be a list of token ids, got 5"),
        ({"stop": ["ok", ""]}, "stop must be a string or a list of non-empty strings"),
        ({"stop": [str(i) for i in range(17)]}, "stop must be at most 16 strings, got 17"),
        ({"stop": ["x" * 257]}, "stop must be strings of at most 256 characters .*, got 257"),
        ({"stop": 3}, "stop must be a string or a list of strings, got 3"),
        ({"ignore_eos": 1}, "ignore_eos must be a bool"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
        ({"repetition_penalty": math.inf}, "repetition_penalty must be a finite number"),
        ({"min_tokens": -1}, r"min_tokens must be an int in \[0, max_tokens=16\]"),
        ({"min_tokens": 17}, "min_tokens must be"),
    ],
)
def test_params_validation_names_field_and_range(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_params_normalise_lists_and_single_stop_string():
    p = SamplingParams(stop_token_ids=[2, 3], stop="###")
    assert p.stop_token_ids == (2, 3) and p.stop == ("###",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(stop=None).stop == ()
    assert SamplingParams(temperature=0).greedy and SamplingParams(top_k=1).greedy
    assert not SamplingParams().greedy and hash(p)  # frozen and hashable once normalised


def test_to_dict_from_dict_round_trip():
    p = SamplingParams(
        max_tokens=9, temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, seed=123, stop_token_ids=(2,),
        stop=("\n\n",), ignore_eos=True, repetition_penalty=1.2, min_tokens=3,
    )  # fmt: skip
    d = p.to_dict()
    assert d["stop_token_ids"] == [2] and d["stop"] == ["\n\n"]
    assert SamplingParams.from_dict(d) == p
    assert SamplingParams.from_dict(msgpack.unpackb(msgpack.packb(d))) == p
    assert SamplingParams.from_dict({}) == SamplingParams()
    with pytest.raises(ValueError, match="unknown SamplingParams field.*'temp'"):
        SamplingParams.from_dict({"temp": 0.5})


def test_greedy_equals_argmax_float_and_bf16():
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0)] * 8
    out = sample(logits, params, [[] for _ in range(8)], [None] * 8)
    assert out.dtype == torch.int64 and torch.equal(out, logits.argmax(-1))
    bf16 = logits.bfloat16()
    assert torch.equal(sample(bf16, params, [[1]] * 8, [None] * 8), bf16.float().argmax(-1))


def test_repetition_penalty_changes_argmax_and_leaves_input_alone():
    logits = torch.tensor([[3.0, 2.5, -1.0, 0.0]])
    before = logits.clone()
    greedy_pen = SamplingParams(temperature=0, repetition_penalty=2.0)
    assert sample(logits, [greedy_pen], [[0, 0, 2]], [None]).item() == 1  # 3.0 / 2 = 1.5 < 2.5
    assert sample(logits, [SamplingParams(temperature=0)], [[0]], [None]).item() == 0
    assert torch.equal(logits, before)
    # A penalty < 1 favours seen tokens: 2.5 / 0.5 = 5.0 beats 3.0.
    assert sample(logits, [SamplingParams(temperature=0, repetition_penalty=0.5)], [[1]], [None]).item() == 1


def test_repetition_penalty_matches_hf_formula():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    histories = [[1, 5, 5, 49, 0], [], [7, 8, 9]]
    penalties = [1.3, 1.3, 0.8]
    ours = apply_repetition_penalty(logits.clone(), penalties, histories)
    for i, (hist, pen) in enumerate(zip(histories, penalties, strict=True)):
        expected = logits[i].clone()
        if hist:
            idx = torch.tensor(hist)
            score = expected.gather(0, idx)
            expected.scatter_(0, idx, torch.where(score < 0, score * pen, score / pen))  # HF's formula
        assert torch.equal(ours[i], expected)


def test_repetition_penalty_matches_hf_processor():
    logits_process = pytest.importorskip("transformers.generation.logits_process")
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(3))
    histories = [[1, 5, 5, 49, 0], [7, 8, 9, 10, 7]]  # equal lengths: HF takes a [B, L] tensor
    hf = logits_process.RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor(histories), logits.clone())
    assert torch.equal(apply_repetition_penalty(logits.clone(), [1.3, 1.3], histories), hf)


def test_banned_ids_are_never_drawn():
    logits = torch.tensor([[5.0, 4.0, 0.0]])
    assert sample(logits, [SamplingParams(temperature=0)], [[]], [None], banned=[[0]]).item() == 1
    keys = [(0, i) for i in range(200)]
    out = sample(logits.expand(200, -1), [RANDOM] * 200, [[]] * 200, keys, banned=[[0, 1]] * 200)
    assert set(out.tolist()) == {2}


def test_top_k_1_and_tiny_top_p_equal_greedy():
    logits = torch.randn(16, 64, generator=torch.Generator().manual_seed(2))
    keys = [(s, 0) for s in range(16)]
    hist = [[] for _ in range(16)]
    assert torch.equal(sample(logits, [SamplingParams(top_k=1)] * 16, hist, keys), logits.argmax(-1))
    tiny_p = [SamplingParams(temperature=1.5, top_p=1e-6)] * 16
    assert torch.equal(sample(logits, tiny_p, hist, keys), logits.argmax(-1))
    tiny_t = [SamplingParams(temperature=1e-30)] * 16  # stays finite rather than turning into nan
    assert torch.equal(sample(logits * 100, tiny_t, hist, keys), logits.argmax(-1))


def test_top_k_and_top_p_keep_the_right_set():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    assert set(draw_many(logits, SamplingParams(top_k=2), 2000).tolist()) == {0, 1}
    # 0.5 + 0.3 >= 0.75: the smallest prefix reaching top_p is the first two tokens.
    assert set(draw_many(logits, SamplingParams(top_p=0.75), 2000).tolist()) == {0, 1}
    assert set(draw_many(logits, SamplingParams(top_p=0.45), 500).tolist()) == {0}
    assert set(draw_many(logits, SamplingParams(top_k=100), 2000).tolist()) == {0, 1, 2, 3}  # k > V: no-op
    # Ties with the cutoff all stay (as HF and vLLM), so the kept set never depends on how a sort orders ties.
    tied = torch.tensor([1.0, 1.0, 1.0, -5.0])
    assert set(draw_many(tied, SamplingParams(top_k=2), 2000).tolist()) == {0, 1, 2}


def test_min_p_filters_below_threshold():
    logits = torch.tensor([0.4, 0.3, 0.2, 0.05, 0.05]).log()
    # Threshold 0.3 * 0.4 = 0.12: tokens 3 and 4 can never be drawn; 0, 1, 2 all show up.
    assert set(draw_many(logits, SamplingParams(min_p=0.3), 4000).tolist()) == {0, 1, 2}
    assert set(draw_many(logits, SamplingParams(), 4000).tolist()) == {0, 1, 2, 3, 4}


def test_same_seed_same_sequence_different_seed_different():
    flat = torch.zeros(1, 1000)

    def run(seed: int) -> list[int]:
        return [sample(flat, [RANDOM], [[]], [(seed, i)]).item() for i in range(20)]

    assert run(42) == run(42)
    assert run(42) != run(43)  # equal by chance with probability 1e-60


def test_row_token_independent_of_batch_companions_and_order():
    torch.manual_seed(0)
    steps = [torch.randn(1, 300) for _ in range(10)]
    target = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.01, repetition_penalty=1.1, seed=7)
    companions = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.3),
        SamplingParams(top_k=5, repetition_penalty=1.5),
        SamplingParams(top_p=0.3, min_p=0.2),
    ]

    def run(n_before: int, n_after: int, order: list[int]) -> list[int]:
        picked = [companions[i] for i in order]
        tokens = []
        for step, logits in enumerate(steps):
            rows = [torch.randn(1, 300) for _ in range(n_before)] + [logits]
            rows += [torch.randn(1, 300) for _ in range(n_after)]
            params = picked[:n_before] + [target] + picked[n_before : n_before + n_after]
            keys = [(100 + i, step) for i in order[:n_before]] + [(7, step)]
            keys += [(100 + i, step) for i in order[n_before : n_before + n_after]]
            out = sample(torch.cat(rows), params, [[3, 4, 5]] * len(params), keys)
            tokens.append(out[n_before].item())
        return tokens

    alone = run(0, 0, [])
    assert run(2, 2, [0, 1, 2, 3]) == alone
    assert run(3, 1, [3, 2, 0, 1]) == alone
    assert run(0, 4, [1, 3, 0, 2]) == alone


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_distribution_matches_softmax(temperature):
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    n = 20000
    counts = torch.bincount(draw_many(logits, SamplingParams(temperature=temperature), n), minlength=4)
    expected = (logits / temperature).softmax(-1)
    assert torch.allclose(counts / n, expected, atol=0.02)


def test_errors_for_missing_key_and_length_mismatch():
    logits = torch.zeros(2, 5)
    with pytest.raises(ValueError, match=r"rows \[1\] sample randomly .* have no key; give each such row"):
        sample(logits, [SamplingParams(temperature=0), RANDOM], [[], []], [None, None])
    with pytest.raises(ValueError, match="one params/history/key"):
        sample(logits, [RANDOM], [[]], [(0, 0)])
    with pytest.raises(ValueError, match="a draw index counts the tokens .* got -1"):
        uniform(0, -1)


def test_a_row_whose_params_fail_gets_failed_and_the_others_their_tokens():
    from ringsched.comm.messages import BatchPlan, NewRequest, PlanEntry
    from ringsched.stage.sampler_state import FAILED, SamplerState

    state = SamplerState(torch.device("cpu"), eos_ids=(2,))
    good = SamplingParams(temperature=0, min_tokens=1)
    # Out of the vocabulary: the planner refuses this; here it reaches the sampler, whose ban indexes the logits.
    bad = SamplingParams(temperature=0, min_tokens=1, stop_token_ids=[500])
    plan = BatchPlan(0, 0, entries=[PlanEntry("good", 0, [1, 2], True), PlanEntry("bad", 0, [3], True)],
                     announce=[NewRequest("good", [], good.to_dict(), 2), NewRequest("bad", [], bad.to_dict(), 1)])
    state.apply(plan)
    logits = torch.randn(2, 100, generator=torch.Generator().manual_seed(0))
    logits[:, 2] = -10.0  # eos, banned under min_tokens: keep it from being the argmax anyway
    tokens = state.sample(plan, logits)[1]
    assert tokens.tolist() == [int(logits[0].argmax()), FAILED]


def _reference_penalised(row, p, history, prompt_len):
    """The formulas, one token at a time: bias, repetition penalty, then OpenAI's frequency and presence."""
    x = row.clone()
    for tok, bias in p.logit_bias:
        x[tok] += bias
    if p.repetition_penalty != 1.0:
        for t in set(history):
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(history[prompt_len:]):
        c = history[prompt_len:].count(t)
        x[t] -= c * p.frequency_penalty + p.presence_penalty
    return x


def test_penalties_and_bias_match_the_formulas():
    from ringsched.sampling.sampler import apply_logit_bias, apply_openai_penalties, apply_repetition_penalty

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 50, generator=g) * 3
    params = [
        SamplingParams(temperature=0, frequency_penalty=0.7, presence_penalty=0.3),
        SamplingParams(temperature=0, presence_penalty=-1.5, logit_bias={"3": 2.5, 7: -4}),
        SamplingParams(temperature=0, repetition_penalty=1.3, frequency_penalty=-0.4),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, frequency_penalty=2.0, logit_bias=[[9, 100]]),
    ]
    histories = [[1, 2, 3, 3, 3, 4], [5, 5, 6, 7, 8], [9, 9, 10, 11, 11, 11], [1, 2], [9, 1, 1]]
    prompt_lens = [2, 1, 3, 2, 1]
    got = logits.clone()
    apply_logit_bias(got, params)
    apply_repetition_penalty(got, [p.repetition_penalty for p in params], histories)
    apply_openai_penalties(got, params, [h[n:] for h, n in zip(histories, prompt_lens, strict=True)])
    for i, p in enumerate(params):
        want = _reference_penalised(logits[i], p, histories[i], prompt_lens[i])
        assert torch.allclose(got[i], want, atol=1e-6), i
    tokens = sample(logits, params, histories, [None] * 5, None, prompt_lens)
    assert tokens.tolist() == got.argmax(dim=-1).tolist()
    assert tokens[4].item() == 9  # +100 wins over the frequency penalty of 2 x 1 occurrence
    assert params[1].logit_bias == ((3, 2.5), (7, -4.0)) and not params[1].plain and params[3].plain


def test_a_row_with_penalties_does_not_change_its_neighbours():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 40, generator=g)
    plain = [SamplingParams(temperature=0)] * 3
    mixed = [SamplingParams(temperature=0), SamplingParams(temperature=0, presence_penalty=2.0), plain[2]]
    hist = [[1, 2], [int(logits[1].argmax())] * 3, [3]]
    a = sample(logits, plain, hist, [None] * 3, None, [0, 0, 0])
    b = sample(logits, mixed, hist, [None] * 3, None, [0, 0, 0])
    assert a[0] == b[0] and a[2] == b[2] and a[1] != b[1]


@pytest.mark.parametrize(
    "kw, message",
    [({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
     ({"logit_bias": {"1": 101}}, "logit_bias"), ({"logit_bias": {"a": 1}}, "logit_bias"),
     ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias")],
)  # fmt: skip
def test_penalty_and_bias_bounds(kw, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kw)
    assert SamplingParams.from_dict(SamplingParams(logit_bias={"4": 1}).to_dict()).logit_bias == ((4, 1.0),)


# -- counter-based draws: a token's uniform is a function of (seed, index), nothing else -------------------------
def test_uniform_is_a_pure_function_of_seed_and_index():
    from ringsched.sampling.sampler import _mix64

    # splitmix64 itself: the first output of the reference generator seeded with 0.
    assert _mix64(0x9E3779B97F4A7C15) == 0xE220A8397B1DCDAF
    # Pinned values: the same bits on every machine, device and process (plain 64-bit integer arithmetic).
    assert uniform(0, 0) == 0.6524484863740322
    assert uniform(7, 3) == 0.6042348053683145
    assert uniform(-1, 5) == uniform(2**64 - 1, 5)  # a negative seed wraps, as torch's manual_seed does
    assert [uniform(42, i) for i in range(50)] == [uniform(42, i) for i in range(50)]
    row = torch.randn(1, 300, generator=torch.Generator().manual_seed(5))
    alone = [sample(row, [RANDOM], [[]], [(42, i)]).item() for i in range(20)]
    companions = torch.randn(3, 300, generator=torch.Generator().manual_seed(6))
    for i in range(20):  # the same key, in a batch, at another row, with other companions: the same token
        batch = torch.cat([companions[:2], row, companions[2:]])
        keys = [(9, 100 + i), (10, i), (42, i), (11, 0)]
        assert sample(batch, [RANDOM] * 4, [[]] * 4, keys)[2].item() == alone[i]
        flipped = torch.cat([row, companions.flip(0)])
        assert sample(flipped, [RANDOM] * 4, [[]] * 4, [(42, i), (1, i), (2, i), (3, i)])[0].item() == alone[i]


def test_uniforms_are_spread_evenly_and_streams_of_nearby_seeds_differ():
    n = 4000
    us = [uniform(1234, i) for i in range(n)]
    assert all(0.0 <= u < 1.0 for u in us) and len(set(us)) == n
    assert abs(sum(us) / n - 0.5) < 0.02  # the mean's standard error is 0.0046
    assert abs(sum((u - 0.5) ** 2 for u in us) / n - 1 / 12) < 0.005
    counts = torch.histc(torch.tensor(us, dtype=torch.float64), bins=10, min=0, max=1)
    assert ((counts - n / 10) ** 2 / (n / 10)).sum() < 35  # chi-square, 9 d.o.f.: P(> 35) < 1e-4
    # `n` sequences get seeds s, s + 1, ...: their streams must not be shifted copies of each other.
    assert not set(us) & {uniform(1235, i) for i in range(n)}
    assert len({uniform(s, 0) for s in range(1000)}) == 1000


def test_sampled_frequencies_match_a_small_distribution():
    probs = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03])
    n = 20000
    counts = torch.bincount(draw_many(probs.log(), RANDOM, n, seed=99), minlength=5).double()
    chi2 = ((counts - n * probs.double()) ** 2 / (n * probs.double())).sum().item()
    # 4 degrees of freedom: P(chi2 > 30) < 1e-5 for a fair draw (this one scores 6.3); a draw that moved 0.01 of
    # the mass off the rarest token (u * 0.99) scores 91.
    assert chi2 < 30, (chi2, counts.tolist())


def _decode(state, rid: str, start: int, ids: list[int], logits: torch.Tensor, announce=()) -> int:
    from ringsched.comm.messages import BatchPlan, PlanEntry

    plan = BatchPlan(0, 0, entries=[PlanEntry(rid, start, ids, True)], announce=list(announce))
    state.apply(plan)
    return state.sample(plan, logits)[1].item()


def test_a_fresh_sampler_state_resumes_a_request_token_for_token():
    """A replacement process (or a recomputation after preemption) that gets the announcement and the history so
    far samples exactly the tokens the original last stage went on to sample."""
    from ringsched.comm.messages import NewRequest
    from ringsched.stage.sampler_state import SamplerState

    prompt, steps = [5, 6, 7], 12
    params = SamplingParams(temperature=1.0, top_p=0.95, repetition_penalty=1.1, seed=2024, max_tokens=steps)
    announce = [NewRequest("r", [], params.to_dict(), len(prompt))]

    # The model's logits for the next token after a history: any fixed function of it, flat enough to be random.
    def logits_after(history):
        return torch.randn(1, 64, generator=torch.Generator().manual_seed(hash(tuple(history)) % 2**32)) * 0.5

    original, out = SamplerState(torch.device("cpu")), []
    out.append(_decode(original, "r", 0, prompt, logits_after(prompt), announce))
    for _ in range(steps - 1):
        history = prompt + out
        out.append(_decode(original, "r", len(history) - 1, history[-1:], logits_after(history)))
    assert len(set(out)) > 3  # it really sampled
    for k in (1, 5, steps - 1):
        fresh, history = SamplerState(torch.device("cpu")), prompt + out[:k]
        resumed = [_decode(fresh, "r", 0, history, logits_after(history), announce)]  # recomputes from 0
        for _ in range(k + 1, steps):
            history = prompt + out[: len(resumed) + k]
            resumed.append(_decode(fresh, "r", len(history) - 1, history[-1:], logits_after(history)))
        assert resumed == out[k:], k
    # The original, recomputing after a preemption, draws the same token again.
    assert _decode(original, "r", 0, prompt + out[:4], logits_after(prompt + out[:4])) == out[4]
