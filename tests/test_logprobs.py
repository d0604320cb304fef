"""Log-probabilities through the `openai` client against transformers' `log_softmax`, at PP=1 (PP=2: the same
check on `test_server.py`'s server): the sampled token's and the top 5, for completions (streamed and whole) and
chat; and through the offline engine at PP=2."""

from __future__ import annotations

import openai
import pytest
import torch

from ringsched.bench.server_process import ServerProcess
from ringsched.tokenizer import Tokenizer

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three colours."}]
N = 10


def _reference(hf, ids: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy continuation of `ids` (n tokens) and the log-probabilities `[n, V]` it chose them from."""
    gen = []
    with torch.no_grad():
        for _ in range(n):
            logits = hf(torch.tensor([ids + gen])).logits[0, -1]
            gen.append(int(logits.argmax()))
        logits = hf(torch.tensor([ids + gen])).logits[0, len(ids) - 1 : -1]
    return gen, torch.log_softmax(logits.float(), dim=-1)


def references(hf, tok: Tokenizer) -> dict:
    return {"tok": tok, "completion": _reference(hf, tok.encode(PROMPT), N),
            "chat": _reference(hf, tok.apply_chat_template(CHAT), N)}  # fmt: skip


@pytest.fixture(scope="module")
def reference(hf_smol, smollm2_dir):
    return references(hf_smol[0], Tokenizer(smollm2_dir))


def _check(tok: Tokenizer, ref: tuple[list[int], torch.Tensor], tokens: list[str], chosen: list[float],
           tops: list[dict[str, float]]) -> None:  # fmt: skip
    gen, lp = ref
    assert tokens == [tok.decode([t], skip_special_tokens=False) for t in gen]
    for i, t in enumerate(gen):
        assert abs(chosen[i] - lp[i, t].item()) < 1e-4, (i, chosen[i], lp[i, t].item())
        values, ids = lp[i].topk(5)
        want = {tok.decode([int(j)], skip_special_tokens=False): v.item() for j, v in zip(ids, values, strict=True)}
        assert set(want) <= set(tops[i]), (i, want, tops[i])
        assert all(abs(tops[i][k] - v) < 1e-4 for k, v in want.items()), (i, want, tops[i])


def check_server(client: openai.OpenAI, reference: dict) -> None:
    """Completions (whole and streamed) and chat log-probabilities against `reference` (`references`)."""
    tok = reference["tok"]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=N, temperature=0, logprobs=5)
    lp = r.choices[0].logprobs
    _check(tok, reference["completion"], lp.tokens, lp.token_logprobs, lp.top_logprobs)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(N)]
    assert "".join(lp.tokens) == r.choices[0].text

    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=N, temperature=0, logprobs=5,
                                            stream=True))  # fmt: skip
    parts = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [x for p in parts for x in p.token_logprobs] == lp.token_logprobs

    c = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=N, temperature=0, logprobs=True,
                                       top_logprobs=5)  # fmt: skip
    content = c.choices[0].logprobs.content
    tops = [{t.token: t.logprob for t in e.top_logprobs} for e in content]
    assert all(len(e.top_logprobs) == 5 for e in content)
    _check(tok, reference["chat"], [e.token for e in content], [e.logprob for e in content], tops)
    assert content[0].bytes == list(content[0].token.encode())

    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
    assert plain.choices[0].logprobs is None


def test_logprobs_equal_transformers_at_pp1(reference):
    """PP=1 here; PP=2 in `test_server.py`, on its server."""
    args = ["--pp-size", "1", "--threads-per-stage", "1", "--kv-cache-memory", "64M"]
    with ServerProcess(args) as srv:
        check_server(openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0, timeout=120), reference)


def test_offline_engine_returns_logprobs(reference):
    from ringsched.engine import Engine
    from ringsched.sampling.params import SamplingParams

    gen, lp = reference["completion"]
    with Engine(MODEL, pp_size=2, threads_per_stage=1, kv_cache_memory="64M", log_level="warning") as llm:
        out = llm.generate([PROMPT], SamplingParams(max_tokens=N, temperature=0, logprobs=3))[0]
        sampled = llm.generate([PROMPT], SamplingParams(max_tokens=N, temperature=0.8, seed=5, logprobs=0))[0]
    assert out.token_ids == gen and len(out.logprobs) == N
    for i, (chosen, top) in enumerate(out.logprobs):
        assert abs(chosen - lp[i, gen[i]].item()) < 1e-4
        values, ids = lp[i].topk(3)
        assert [t for t, _ in top] == ids.tolist()
        assert all(abs(v - w) < 1e-4 for (_, v), w in zip(top, values.tolist(), strict=True))
    assert [top for _, top in sampled.logprobs] == [[]] * N and all(v <= 0 for v, _ in sampled.logprobs)
