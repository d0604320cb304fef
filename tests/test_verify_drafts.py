"""Verifying drafts on the last stage (`speculative/verify.py`): with drafts right and wrong, greedy and seeded
sampling (temperature, top-p, penalties) produce exactly the tokens decoding without drafts produces; drafts are
kept as often as the target distribution gives them, and a rejected position draws from the residual."""

from __future__ import annotations

import random

import torch

from ringsched.sampling.params import SamplingParams
from ringsched.sampling.sampler import sample
from ringsched.speculative.ngram import NgramIndex
from ringsched.speculative.verify import accept, verify

VOCAB = 12
TABLE = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(0)) * 2.0


def model(history: list[int]) -> torch.Tensor:
    """A tiny deterministic 'model': next-token logits from the last two tokens."""
    return TABLE[history[-1]] + 0.5 * TABLE[history[-2]].roll(1)


def plain(prompt: list[int], params: SamplingParams, seed: int, steps: int) -> list[int]:
    out: list[int] = []
    for n in range(steps):
        h = prompt + out
        out += sample(model(h)[None], [params], [h], [(seed, n)], prompt_lens=[len(prompt)]).tolist()
    return out


def speculative(prompt: list[int], params: SamplingParams, seed: int, steps: int, drafter) -> tuple[list[int], int]:
    out: list[int] = []
    kept_drafts = 0
    while len(out) < steps:
        h = prompt + out
        draft = drafter(h, out)
        logits = torch.stack([model(h + draft[:j]) for j in range(len(draft) + 1)])
        (kept,) = verify(logits, [draft], [params], [h], [(seed, len(out))], prompt_lens=[len(prompt)])
        kept_drafts += len(kept) - 1
        out += kept
    return out[:steps], kept_drafts


PARAMS = [SamplingParams(temperature=0.0, max_tokens=1), SamplingParams(temperature=0.8, top_p=0.9, max_tokens=1),
          SamplingParams(temperature=1.0, repetition_penalty=1.3, frequency_penalty=0.4, max_tokens=1)]  # fmt: skip


def test_tokens_equal_decoding_without_drafts_whatever_the_drafts():
    rng = random.Random(0)
    for params in PARAMS:
        for seed in range(6):
            prompt = [rng.randrange(VOCAB) for _ in range(8)] * 2
            want = plain(prompt, params, seed, 40)

            def oracle(h, out, want=want):  # the true continuation, with a wrong token now and then
                d = want[len(out) : len(out) + rng.randrange(0, 6)]
                if d and rng.random() < 0.5:
                    d[rng.randrange(len(d))] = (d[0] + 1) % VOCAB
                return d

            def ngram(h, out):
                return NgramIndex(h, 1, 3).propose(4)

            got, kept = speculative(prompt, params, seed, 40, oracle)
            assert got == want and kept > 0  # drafts were kept, and changed nothing
            assert speculative(prompt, params, seed, 40, ngram)[0] == want


def test_a_draft_is_kept_with_its_target_probability_and_a_rejection_draws_the_residual():
    params = SamplingParams(temperature=1.0, max_tokens=1)
    history = [3, 5]
    p = torch.softmax(model(history), dim=-1)
    draft = int(p.argsort()[-2])  # a token of middling probability
    draws = 4000
    firsts = []
    for seed in range(draws):
        logits = torch.stack([model(history), model(history + [draft])])
        (kept,) = verify(logits, [[draft]], [params], [history], [(seed, 0)])
        firsts.append(kept[0])
    rate = sum(t == draft for t in firsts) / draws
    sigma = (p[draft].item() * (1 - p[draft].item()) / draws) ** 0.5
    assert abs(rate - p[draft].item()) < 4 * sigma
    residual = p.clone()
    residual[draft] = 0
    residual /= residual.sum()
    rejected = [t for t in firsts if t != draft]
    for token in range(VOCAB):
        if token == draft:
            continue
        freq = sum(t == token for t in rejected) / len(rejected)
        q = residual[token].item()
        assert abs(freq - q) < 4 * (q * (1 - q) / len(rejected)) ** 0.5 + 1e-9, token


def test_accept_keeps_the_agreeing_prefix_and_one_more():
    assert accept([4, 5, 6, 7], [4, 5, 6]) == [4, 5, 6, 7]
    assert accept([4, 9, 6, 7], [4, 5, 6]) == [4, 9]
    assert accept([1], []) == [1]
