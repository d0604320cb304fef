"""Log-probabilities through the `openai` client against transformers' `log_softmax` (`check_server`, run on
`test_server.py`'s PP=2 server): the sampled token's and the top 5, for completions (streamed and whole) and chat,
the prompt's (`prompt_logprobs`, `echo` with `logprobs`); and through the offline engine at PP=2. (PP=1's last
stage is the same code: `test_loop_in_process.py` and `test_prompt_logprobs.py` check it against transformers.)"""

from __future__ import annotations

import openai
import pytest
import torch

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
    with torch.no_grad():
        prompt = torch.log_softmax(hf(torch.tensor([tok.encode(PROMPT)])).logits[0].float(), dim=-1)
    return {"tok": tok, "completion": _reference(hf, tok.encode(PROMPT), N),
            "chat": _reference(hf, tok.apply_chat_template(CHAT), N), "prompt": prompt}  # fmt: skip


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
    check_prompt_logprobs(client, reference, lp)


def check_prompt_logprobs(client: openai.OpenAI, reference: dict, generated) -> None:
    """vLLM's `prompt_logprobs` (each prompt token's log-probability, rank and the top 3 at the position before it)
    and `echo` with `logprobs` (the prompt's tokens lead the completion's, whole and streamed) against a forward
    pass of the prompt; `generated`: the completion's own log-probabilities."""
    tok, lsm = reference["tok"], reference["prompt"]
    ids = tok.encode(PROMPT)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0,
                                  extra_body={"prompt_logprobs": 3})  # fmt: skip
    scores = r.choices[0].model_extra["prompt_logprobs"]
    assert len(scores) == len(ids) and scores[0] is None
    for p in range(1, len(ids)):
        own = scores[p][str(ids[p])]
        assert abs(own["logprob"] - lsm[p - 1, ids[p]].item()) < 1e-4, (p, own)
        assert own["rank"] == int((lsm[p - 1] > lsm[p - 1, ids[p]]).sum()) + 1
        assert own["decoded_token"] == tok.decode([ids[p]], skip_special_tokens=False)
        values, top = lsm[p - 1].topk(3)
        assert all(abs(scores[p][str(int(i))]["logprob"] - v.item()) < 1e-4 for i, v in zip(top, values, strict=True))
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1, extra_body={"prompt_logprobs": 0})
    chat_ids = tok.apply_chat_template(CHAT)
    listed = chat.model_extra["prompt_logprobs"]  # beside the choices, as vLLM's
    assert len(listed) == len(chat_ids) and listed[0] is None
    assert [next(iter(e)) for e in listed[1:]] == [str(i) for i in chat_ids[1:]]  # each the prompt token's own
    e = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=N, temperature=0, echo=True, logprobs=5)
    lp = e.choices[0].logprobs
    assert e.choices[0].text == PROMPT + "".join(generated.tokens)
    assert lp.tokens == [tok.decode([i], skip_special_tokens=False) for i in ids] + generated.tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(abs(lp.token_logprobs[p] - lsm[p - 1, ids[p]].item()) < 1e-4 for p in range(1, len(ids)))
    assert lp.token_logprobs[len(ids) :] == pytest.approx(generated.token_logprobs, abs=1e-6)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=N, temperature=0, echo=True,
                                            logprobs=5, stream=True))  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks if c.choices) == e.choices[0].text
    parts = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [x for p in parts for x in p.token_logprobs] == lp.token_logprobs


def test_offline_engine_returns_logprobs(reference):
    from ringsched.engine import Engine
    from ringsched.sampling.params import SamplingParams

    gen, lp = reference["completion"]
    with Engine(MODEL, pp_size=2, threads_per_stage=1, kv_cache_memory="64M", log_level="warning") as llm:
        out = llm.generate([PROMPT], SamplingParams(max_tokens=N, temperature=0, logprobs=3))[0]
        sampled = llm.generate([PROMPT], SamplingParams(max_tokens=N, temperature=0.8, seed=5, logprobs=0))[0]
        scored = llm.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2))[0]
    ids, lsm = scored.prompt_token_ids, reference["prompt"]
    assert scored.prompt_logprobs[0] is None and len(scored.prompt_logprobs) == len(ids)
    for p, (chosen, rank, top) in enumerate(scored.prompt_logprobs[1:], start=1):
        assert abs(chosen - lsm[p - 1, ids[p]].item()) < 1e-4 and rank >= 1 and len(top) == 2
    assert out.token_ids == gen and len(out.logprobs) == N
    for i, (chosen, top) in enumerate(out.logprobs):
        assert abs(chosen - lp[i, gen[i]].item()) < 1e-4
        values, ids = lp[i].topk(3)
        assert [t for t, _ in top] == ids.tolist()
        assert all(abs(v - w) < 1e-4 for (_, v), w in zip(top, values.tolist(), strict=True))
    assert [top for _, top in sampled.logprobs] == [[]] * N and all(v <= 0 for v, _ in sampled.logprobs)
