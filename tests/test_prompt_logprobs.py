"""Prompt log-probabilities (`SamplingParams.prompt_logprobs`): the ring scores each prompt token at the position
before it, chunk by chunk, and the scores equal a forward pass's log_softmax (transformers) at every layout."""

from __future__ import annotations

import pytest
import torch

from ringsched.comm.messages import NewRequest
from ringsched.sampling.params import SamplingParams
from ringsched.sampling.prompt_logprobs import prompt_targets, score_values, score_width, unpack_scores
from ringsched.scheduler.refusals import refusal
from ringsched.weights.model_config import ModelConfig
from tests.test_loop_in_process import run_ring


def test_scores_pack_and_unpack():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [3.0, 0.5, 0.5, -1.0]])
    ks = [2, 0]
    values = score_values(logits, torch.tensor([1, 3]), ks)
    assert len(values) == score_width(ks) == 2 + 2 * 2 + 2
    (lp0, rank0, top0), (lp1, rank1, top1) = unpack_scores(values.tolist(), ks)
    lsm = torch.log_softmax(logits, dim=-1)
    assert lp0 == pytest.approx(lsm[0, 1].item()) and rank0 == 3
    assert [i for i, _ in top0] == [3, 2] and top0[0][1] == pytest.approx(lsm[0, 3].item())
    assert lp1 == pytest.approx(lsm[1, 3].item()) and rank1 == 4 and top1 == []


def test_an_entry_scores_the_prompt_tokens_after_its_positions():
    prompt = [10, 11, 12, 13, 14]
    assert prompt_targets(prompt, 0, 2) == [11, 12]
    assert prompt_targets(prompt, 2, 3) == [13, 14]  # the last position's next token is an output: not scored
    assert prompt_targets(prompt, 4, 1) == []
    assert prompt_targets([7], 0, 1) == []


def test_context_parallel_stage_zero_refuses_them():
    params = SamplingParams(prompt_logprobs=1)
    kw = dict(max_len=64, capacity_tokens=1000, vocab_size=100, in_use=False)
    assert refusal(NewRequest("a", [1, 2], params.to_dict()), params, **kw) is None
    error = refusal(NewRequest("a", [1, 2], params.to_dict()), params, **kw, scores_prompts=False)
    assert "prompt_logprobs" in error and "--cp-size" in error


def test_the_field_is_checked():
    with pytest.raises(ValueError, match="prompt_logprobs must be"):
        SamplingParams(prompt_logprobs=21)


@pytest.fixture(scope="module")
def forward(tiny_llama_dir):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)

    return logprobs


def _check(scores: list, ids: list[int], k: int, lsm: torch.Tensor) -> None:
    assert len(scores) == len(ids) - 1
    for p, (lp, rank, top) in enumerate(scores, start=1):
        row = lsm[p - 1]
        assert lp == pytest.approx(row[ids[p]].item(), abs=1e-4)
        assert row.sort(descending=True).values[rank - 1].item() == pytest.approx(lp, abs=1e-4)  # ties either way
        want = row.topk(k)
        assert len(top) == k
        assert [v for _, v in top] == pytest.approx(want.values.tolist(), abs=1e-4)


def _requests(vocab: int) -> list:
    prompt = [(7 * i + 3) % vocab for i in range(23)]
    return [
        (prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=3)),
        ([5, 6, 7, 8], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)),
        (prompt, SamplingParams(max_tokens=3, temperature=0.8, seed=1, ignore_eos=True, prompt_logprobs=0)),
        ([9], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, prompt_logprobs=2)),
    ]


@pytest.mark.parametrize("pp_size, kw", [(1, {}), (3, {"chunked_prefill_size": 7, "pp_max_micro_batch_size": 2})])
def test_scores_equal_a_forward_pass(tiny_llama_dir, forward, pp_size, kw):
    """Prompts over several chunks, beside requests that do not ask (their tokens unchanged), sampled and greedy;
    with prefix caching on, a second request of the same prompt is scored whole (no cached position skipped)."""
    reqs = _requests(ModelConfig.from_dir(tiny_llama_dir).vocab_size)
    scores: dict = {}
    got = run_ring(str(tiny_llama_dir), reqs, pp_size=pp_size, scores=scores, enable_prefix_caching=True, **kw)
    unscored = [(ids, SamplingParams(**{**p.to_dict(), "prompt_logprobs": None})) for ids, p in reqs]
    assert got == run_ring(str(tiny_llama_dir), unscored, pp_size=pp_size, **kw)  # scoring changes no token
    prompt = reqs[0][0]
    lsm = forward(prompt)
    _check(scores["r0"], prompt, 3, lsm)
    _check(scores["r2"], prompt, 0, lsm)
    assert scores["r3"] == [] and "r1" not in scores
