"""The HTTP server end to end: a real server (SmolLM2, two stages) in a subprocess, driven by `openai` and httpx.

One server serves the whole module. The greedy reference comes from the offline `Engine` with the same model
and pipeline split, run once before the server starts (two stage sets on two cores would only slow both).
"""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import httpx
import openai
import pytest
from fuzz_cases import CASES

from ringsched.bench.server_process import ServerProcess

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
KEY = "test-key"
COMPLETION_PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
MAX_LEN = 2048  # --max-model-len: the context-length error names it
GREEDY = {"temperature": 0, "max_tokens": 24}
# SmolLM2's own template where a request has no tools (the greedy checks hold), hermes tool use where it has
TOOLS_TEMPLATE = Path(__file__).parent / "templates" / "smollm2_tools.jinja"


@pytest.fixture(scope="module")
def reference(smollm2_dir) -> dict[str, str]:
    """Greedy texts from the offline engine (same model, pp_size 2) for the prompts the tests send."""
    from ringsched.engine import Engine
    from ringsched.sampling.params import SamplingParams

    with Engine(MODEL, pp_size=2, threads_per_stage=1, kv_cache_memory="64M") as llm:
        chat_ids = llm.tokenizer.apply_chat_template(CHAT)
        outs = llm.generate([COMPLETION_PROMPT, chat_ids], SamplingParams(max_tokens=24, temperature=0))
    return {"completion": outs[0].text, "chat": outs[1].text}


@pytest.fixture(scope="module")
def server(reference) -> ServerProcess:
    args = ["--pp-size", "2", "--threads-per-stage", "1", "--kv-cache-memory", "128M", "--max-model-len", str(MAX_LEN),
            "--chat-template", str(TOOLS_TEMPLATE), "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    with ServerProcess(args, api_key=KEY) as srv:
        yield srv


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)


def metrics(server: ServerProcess) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics", headers=server.headers, timeout=10).text
    out = {}
    for line in text.splitlines():
        m = re.match(r"^(ringsched:[^\s]+)\s+([0-9.eE+-]+|NaN)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def settled(server: ServerProcess) -> dict[str, float]:
    """/metrics once the stages' reports (every 0.5 s) have caught up with the last request: two reads a second
    apart agree."""
    last = metrics(server)
    for _ in range(20):
        time.sleep(1.0)
        now = metrics(server)
        if all(now.get(k) == v for k, v in last.items() if "stage_tokens" in k):
            return now
        last = now
    return last


# -- generation ------------------------------------------------------------------------------------------------
def test_completion_greedy_equals_engine(client, reference):
    r = client.completions.create(model=MODEL, prompt=COMPLETION_PROMPT, **GREEDY)
    assert r.choices[0].text == reference["completion"]
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (5, 24, 29)

    stream = client.completions.create(
        model=MODEL, prompt=COMPLETION_PROMPT, stream=True, stream_options={"include_usage": True}, **GREEDY
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == reference["completion"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert 1 < len(chunks) - 1 <= 24  # one chunk per token, fewer when a character spans tokens


def test_chat_greedy_equals_engine(client, reference):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, **GREEDY)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == reference["chat"]
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens

    stream = client.chat.completions.create(model=MODEL, messages=CHAT, stream=True, **GREEDY)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == reference["chat"]
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason


def test_stop_string_spanning_tokens_never_leaks(client, reference):
    full = reference["completion"]  # " Paris.\n\nThe answer is: 2018-01" for SmolLM2
    stop = full[full.index("answer") + 3 : full.index("answer") + 10]  # starts and ends inside tokens
    expected = full[: full.index(stop)]
    r = client.completions.create(model=MODEL, prompt=COMPLETION_PROMPT, stop=[stop, "never seen"], **GREEDY)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (expected, "stop")
    pieces = [
        c.choices[0].text
        for c in client.completions.create(model=MODEL, prompt=COMPLETION_PROMPT, stop=stop, stream=True, **GREEDY)
    ]
    assert "".join(pieces) == expected


def test_generate_native(server, reference):
    body = {"text": COMPLETION_PROMPT, "sampling_params": {"max_new_tokens": 24, "temperature": 0}}
    r = httpx.post(f"{server.url}/generate", json=body, headers=server.headers, timeout=120).json()
    assert r["text"] == reference["completion"]
    assert r["meta_info"]["finish_reason"] == {"type": "length", "length": 24}
    assert (r["meta_info"]["prompt_tokens"], r["meta_info"]["completion_tokens"]) == (5, 24)


def test_prefix_cache_reports_cached_tokens(client, server):
    """A repeated system prompt: its blocks come from the prefix cache; usage and /metrics say how many."""
    system = "You answer in one word, and you never explain your answer to anyone. " * 12
    before = metrics(server)
    usages, texts = [], []
    for question in ("Name a colour.", "Name a colour.", "Name a fruit."):
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        r = client.chat.completions.create(model=MODEL, messages=msgs, **GREEDY)
        usages.append(r.usage)
        texts.append(r.choices[0].message.content)
    cached = [u.prompt_tokens_details.cached_tokens for u in usages]
    assert texts[0] == texts[1]  # greedy: the same answer from cached KV
    assert all(c % 16 == 0 for c in cached) and usages[0].prompt_tokens > 150
    assert cached[1] == (usages[1].prompt_tokens - 1) // 16 * 16  # all but the last token's block
    assert 150 < cached[2] < usages[2].prompt_tokens  # the system prompt, not the question
    deadline, hits = time.monotonic() + 10, 0.0
    while time.monotonic() < deadline:  # stage 0 reports its totals every half second
        after = metrics(server)
        hits = after["ringsched:prefix_cache_hits_total"] - before.get("ringsched:prefix_cache_hits_total", 0)
        if hits >= sum(cached):
            break
        time.sleep(0.2)
    assert hits == sum(cached)
    cached_total = "ringsched:prompt_tokens_cached_total"
    assert after[cached_total] - before.get(cached_total, 0) == sum(cached)
    assert 0 < after["ringsched:prefix_cache_hit_rate"] <= 1


def test_logit_bias_and_penalties(client, smollm2_dir):
    """A +100 bias makes greedy emit its token; a frequency penalty changes a greedy answer that repeats itself."""
    from ringsched.tokenizer import Tokenizer

    tok = Tokenizer(smollm2_dir)
    target = tok.encode(" banana")[0]
    r = client.completions.create(model=MODEL, prompt=COMPLETION_PROMPT, max_tokens=4, temperature=0,
                                  logit_bias={str(target): 100})  # fmt: skip
    assert r.choices[0].text == tok.decode([target] * 4)
    prompt = "one one one one one one one one"
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    penalised = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                          frequency_penalty=2.0, presence_penalty=1.0)  # fmt: skip
    assert plain.choices[0].text != penalised.choices[0].text
    with pytest.raises(openai.BadRequestError, match="presence_penalty"):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, presence_penalty=5)


def test_n_sequences_share_one_prompt_computation(client, server):
    """n=4 with a seed: four different completions, the same four again; the prompt is computed once per call
    but for each sequence's partial last block (the stages' token counters)."""
    prompt = "Write four different words about the sea, the sky and the wind, one per line. " * 3
    kw = dict(model=MODEL, prompt=prompt, max_tokens=12, temperature=1.0, seed=11, n=4, extra_body={"ignore_eos": True})
    before = settled(server)
    first = client.completions.create(**kw)
    second = client.completions.create(**kw)
    texts = [[c.text for c in sorted(r.choices, key=lambda c: c.index)] for r in (first, second)]
    assert len(set(texts[0])) == 4 and texts[0] == texts[1]
    p = first.usage.prompt_tokens
    assert first.usage.completion_tokens == 4 * 12 and first.usage.total_tokens == p + 48
    cached = (p - 1) // 16 * 16
    # The first call computes the prompt once and each other sequence its last partial block; the second finds
    # every whole block cached for all four; each sequence then decodes 11 steps.
    want = (p + 3 * (p - cached)) + 4 * (p - cached) + 8 * 11
    deadline, got = time.monotonic() + 10, {}
    while time.monotonic() < deadline:
        after = metrics(server)
        got = {s: after[f'ringsched:stage_tokens{{stage="{s}"}}'] - before[f'ringsched:stage_tokens{{stage="{s}"}}']
               for s in (0, 1)}  # fmt: skip
        if got == {0: want, 1: want}:
            break
        time.sleep(0.3)
    assert got == {0: want, 1: want}

    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, n=2, stream=True,
                                                 temperature=0.9, seed=3))  # fmt: skip
    ends = {c.choices[0].index: c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason}
    assert ends == {0: "length", 1: "length"}
    best = client.completions.create(model=MODEL, prompt=COMPLETION_PROMPT, max_tokens=5, temperature=1.0, seed=4,
                                     n=1, best_of=3)  # fmt: skip
    assert len(best.choices) == 1 and best.choices[0].logprobs is None and best.usage.completion_tokens == 15
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, n=3, best_of=2)


def test_logprobs_equal_transformers(client, hf_smol, smollm2_dir):
    from test_logprobs import check_server, references

    from ringsched.tokenizer import Tokenizer

    check_server(client, references(hf_smol[0], Tokenizer(smollm2_dir)))


def test_tool_calls_are_schema_valid_and_a_loop_renders_through_the_template(client, server):
    from test_tool_calls import check_real_ring

    check_real_ring(client, server.url, server.headers, MODEL)


def test_json_schema_answers_parse_and_validate(server):
    from test_structured import check_server

    check_server(server.url)


def test_a_grammar_helper_that_dies_costs_only_its_request(server, reference, client):
    """Both grammar helpers are killed (as a native crash would): the two structured requests that meet them get a
    400 naming their field, the replacements serve the next one, and the server never stops serving."""
    helpers = [p for p in server.descendants() if "ringsched.server.grammar_helper" in " ".join(p.cmdline())]
    assert len(helpers) == 2, [p.cmdline() for p in server.descendants()]
    for p in helpers:
        p.kill()
    body = {"model": MODEL, "prompt": "Is Paris in France? Answer:", "max_tokens": 3, "temperature": 0,
            "guided_choice": ["yes", "no"]}  # fmt: skip
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=60) as hc:
        for _ in range(2):
            err = _assert_error(hc.post(CMPL, json=body), 400, "guided_choice")
            assert "crashed the process that checks grammars (exit code -9)" in err["message"], err
            assert hc.get("/health").status_code == 200
        r = hc.post(CMPL, json=body)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("yes", "no"), r.text
    now = [p for p in server.descendants() if "ringsched.server.grammar_helper" in " ".join(p.cmdline())]
    assert len(now) == 2 and not {p.pid for p in now} & {p.pid for p in helpers}
    assert client.completions.create(model=MODEL, prompt=COMPLETION_PROMPT, **GREEDY).choices[0].text == (
        reference["completion"]
    )


def test_64_concurrent_streams(server):
    before = metrics(server)
    prompts = [f"Request {i}: tell me about the number {i}." for i in range(64)]
    lengths = [3 + i % 6 for i in range(64)]

    async def one(ac: openai.AsyncOpenAI, prompt: str, n: int):
        stream = await ac.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=n,
            temperature=0.8,
            seed=len(prompt),
            extra_body={"ignore_eos": True},
            stream=True,
            stream_options={"include_usage": True},
        )
        return [c async for c in stream]

    async def main():
        ac = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=300)
        try:
            return await asyncio.gather(*(one(ac, p, n) for p, n in zip(prompts, lengths, strict=True)))
        finally:
            await ac.close()

    results = asyncio.run(main())
    prompt_total = 0
    for n, chunks in zip(lengths, results, strict=True):
        usage = chunks[-1].usage
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert usage.completion_tokens == n and usage.total_tokens == usage.prompt_tokens + n
        assert len([c for c in chunks if c.choices]) <= n
        prompt_total += usage.prompt_tokens
    after = metrics(server)
    assert after["ringsched:generation_tokens_total"] - before["ringsched:generation_tokens_total"] == sum(lengths)
    assert after["ringsched:prompt_tokens_total"] - before["ringsched:prompt_tokens_total"] == prompt_total
    done = 'ringsched:request_success_total{finished_reason="length"}'
    assert after[done] - before.get(done, 0) == 64


def test_disconnects_free_every_stage(server):
    """16 streams dropped mid-stream and one non-streaming client that gives up: all aborted, all KV freed."""
    before = metrics(server)

    async def drop_after_two_chunks(i: int) -> None:
        body = {"model": MODEL, "prompt": f"Story {i}:", "max_tokens": 500, "ignore_eos": True, "stream": True}
        async with httpx.AsyncClient(headers=server.headers, timeout=60) as hc:
            async with hc.stream("POST", f"{server.url}/v1/completions", json=body) as r:
                seen = 0
                async for line in r.aiter_lines():
                    seen += line.startswith("data: {")
                    if seen == 2:
                        return  # leaving both contexts closes the connection mid-stream

    async def give_up_waiting() -> None:  # a non-streaming client that times out is a disconnect too
        body = {"model": MODEL, "prompt": "Patience:", "max_tokens": 500, "ignore_eos": True}
        async with httpx.AsyncClient(headers=server.headers, timeout=1.5) as hc:
            with pytest.raises(httpx.ReadTimeout):
                await hc.post(f"{server.url}/v1/completions", json=body)

    async def main():
        await asyncio.gather(give_up_waiting(), *(drop_after_two_chunks(i) for i in range(16)))

    asyncio.run(main())
    deadline, m = time.monotonic() + 10, {}
    while time.monotonic() < deadline:
        m = metrics(server)
        kv = [v for k, v in m.items() if k.startswith("ringsched:kv_cache_usage_perc")]
        if len(kv) == 2 and not any(kv) and m["ringsched:num_requests_running"] == 0:
            break
        time.sleep(0.3)
    assert [m[f'ringsched:kv_cache_usage_perc{{stage="{s}"}}'] for s in (0, 1)] == [0.0, 0.0]
    assert m["ringsched:num_requests_running"] == 0
    aborted = 'ringsched:request_success_total{finished_reason="abort"}'
    assert m[aborted] - before.get(aborted, 0) == 17


# -- errors ----------------------------------------------------------------------------------------------------
def _context_message(p: int, c: int, where: str) -> str:
    return (
        f"This model's maximum context length is {MAX_LEN} tokens. However, you requested {p + c} tokens ({p} in the "
        f"{where}, {c} in the completion). Please reduce the length of the {where} or completion."
    )


CMPL, CHAT_PATH = "/v1/completions", "/v1/chat/completions"
ERROR_CASES = [
    # (path, body, status, param, code)
    (CMPL, {"model": MODEL}, 400, "prompt", None),
    (CMPL, {"prompt": 5}, 400, "prompt", None),
    (CMPL, {"prompt": []}, 400, "prompt", None),
    (CMPL, {"prompt": [10**6]}, 400, "prompt", None),
    (CMPL, {"prompt": "hi", "max_tokens": "3"}, 400, "max_tokens", None),
    (CMPL, {"prompt": "hi", "max_tokens": 2.5}, 400, "max_tokens", None),
    (CMPL, {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", None),
    (CMPL, {"prompt": "hi", "max_tokens": -4}, 400, "max_tokens", None),
    (CMPL, {"prompt": "hi", "temperature": -0.5}, 400, "temperature", None),
    (CMPL, {"prompt": "hi", "top_p": 0}, 400, "top_p", None),
    (CMPL, {"prompt": "hi", "top_p": 1.5}, 400, "top_p", None),
    (CMPL, {"prompt": "hi", "stream": "yes"}, 400, "stream", None),
    (CMPL, {"prompt": "hi", "n": 17}, 400, "n", None),
    (CMPL, {"prompt": [1000] * 2040, "max_tokens": 10}, 400, "prompt", "context_length_exceeded"),
    (CMPL, {"model": "gpt-4", "prompt": "hi"}, 404, "model", "model_not_found"),
    (CHAT_PATH, {"model": MODEL}, 400, "messages", None),
    (CHAT_PATH, {"messages": []}, 400, "messages", None),
    (CHAT_PATH, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role", None),
    (CHAT_PATH, {"messages": [{"content": "hi"}]}, 400, "messages[0].role", None),
    (CHAT_PATH, {"messages": CHAT, "max_completion_tokens": 0}, 400, "max_completion_tokens", None),
    (CHAT_PATH, {"messages": CHAT, "temperature": "hot"}, 400, "temperature", None),
    (CHAT_PATH, {"model": "nope", "messages": CHAT}, 404, "model", "model_not_found"),
    ("/generate", {"text": "hi", "input_ids": [1]}, 400, "text", None),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 0}}, 400, "max_new_tokens", None),
    ("/generate", {"text": "hi", "sampling_params": {"beam_width": 2}}, 400, "sampling_params", None),
]


def _assert_error(r: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == ("invalid_request_error" if status in (400, 401, 404) else err["type"])
    assert (err["param"], err["code"]) == (param, code), err
    return err


@pytest.mark.parametrize("path, body, status, param, code", ERROR_CASES)
def test_bad_requests_get_openai_errors(server, path, body, status, param, code):
    r = httpx.post(server.url + path, json=body, headers=server.headers, timeout=30)
    _assert_error(r, status, param, code)


def test_malformed_json_and_context_messages(server, reference, client):
    r = httpx.post(server.url + CMPL, content=b'{"prompt": "hi",', headers=server.headers, timeout=30)
    assert "JSON" in _assert_error(r, 400)["message"]

    r = httpx.post(server.url + CMPL, json={"prompt": [1000] * 2040, "max_tokens": 10}, headers=server.headers)
    assert r.json()["error"]["message"] == _context_message(2040, 10, "prompt")

    from ringsched.tokenizer import Tokenizer
    from ringsched.weights.fetch import resolve_model

    long_chat = [{"role": "user", "content": "word " * 2100}]
    p = len(Tokenizer(resolve_model(MODEL)).apply_chat_template(long_chat))
    r = httpx.post(server.url + CHAT_PATH, json={"messages": long_chat, "max_tokens": 7}, headers=server.headers)
    assert _assert_error(r, 400, "messages", "context_length_exceeded")["message"] == _context_message(p, 7, "messages")

    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=-1)
    assert e.value.status_code == 400 and e.value.body["param"] == "max_tokens"
    # After all the bad requests, the server still answers, and answers right.
    assert (
        client.completions.create(model=MODEL, prompt=COMPLETION_PROMPT, **GREEDY).choices[0].text
        == reference["completion"]
    )


def test_api_key(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        for method, path in (("GET", "/v1/models"), ("GET", "/metrics"), ("POST", CMPL), ("POST", "/generate"),
                             ("GET", "/openapi.json")):  # fmt: skip
            r = httpx.request(method, server.url + path, json={"prompt": "hi"}, headers=headers, timeout=30)
            assert _assert_error(r, 401, None, "invalid_api_key")
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200  # no key needed
    models = httpx.get(f"{server.url}/v1/models", headers=server.headers, timeout=10).json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    lower = {"Authorization": f"bearer {KEY}"}
    assert httpx.get(f"{server.url}/openapi.json", headers=lower, timeout=10).status_code == 200


def test_fuzz_table_against_the_real_server(server, reference, client):
    """Every malformed request of the table gets its status, the OpenAI error shape and its `param`; then the
    server is healthy, nothing is left open, and greedy output is what it was."""
    limit = 8 * 2**20  # the server's default --max-request-bytes
    headers = {**server.headers, "content-type": "application/json"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=60) as hc:
        for case in CASES:
            r = hc.post(case.path, content=case.payload(limit))
            assert r.status_code == case.status, (str(case), r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"], (str(case), err)
            assert err["param"] == case.param, (str(case), err)
            assert err["code"] is None or isinstance(err["code"], str), (str(case), err)
        assert hc.get("/health").status_code == 200
    m = metrics(server)
    assert m["ringsched:num_requests_open"] == 0
    assert m.get('ringsched:request_success_total{finished_reason="error"}', 0) == 0  # none reached the ring
    r = client.completions.create(model=MODEL, prompt=COMPLETION_PROMPT, **GREEDY)
    assert r.choices[0].text == reference["completion"]
    assert client.chat.completions.create(model=MODEL, messages=CHAT, **GREEDY).choices[0].message.content == (
        reference["chat"]
    )
