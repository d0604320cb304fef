"""The chat templates real families ship (Qwen3, Llama 3.1, Mistral Nemo: `real_templates.py`) on tiny random
models, through the `openai` client: each family's tool calls read by its parser (whole and streamed) and a
two-turn loop rendered through its template (Mistral's nine-character call ids included), Qwen3's
`enable_thinking` and reasoning; and on a real ring (Qwen3), `required` and named calls schema-valid on every one
of 20 varied requests, its grammar applying at once where the prompt closed the reasoning."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import httpx
import jsonschema
import openai
import pytest
from fake_ring import FrontEnd
from real_templates import real_template
from test_tool_calls import _streamed

from ringsched.bench.server_process import ServerProcess
from ringsched.models.random_model import random_config, write_random_model
from ringsched.tokenizer import Tokenizer

pytestmark = pytest.mark.slow  # the templates come from a 76 MB source package (once, into the cache)

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
ALERT = {"type": "function", "function": {"name": "set_alert", "description": "Alert when a city's weather changes",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                    "when": {"enum": ["rain", "snow", "wind"]}},
                   "required": ["city", "when"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "Weather in Oslo?"}]
# family: (the parser, what a model of it answers to call, how its template renders the call and the result)
FAMILIES = {
    "qwen3": ("hermes", 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", '
              '"unit": "celsius"}}\n</tool_call>',
              ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n</tool_call>',
               "<tool_response>\n-3 C, snow\n</tool_response>"]),
    "llama3.1": ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}}',
                 ['{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}}<|eot_id|>',
                  'ipython<|end_header_id|>\n\n"-3 C, snow"<|eot_id|>', "Environment: ipython"]),
    "mistral": ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}]',
                ['[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}, '
                 '"id": "{id}"}]',
                 '[TOOL_RESULTS]{"content": -3 C, snow, "call_id": "{id}"}[/TOOL_RESULTS]', "[AVAILABLE_TOOLS]"]),
}  # fmt: skip


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cfg = random_config("qwen3", layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab=512, tie=True)
    return write_random_model(tmp_path_factory.mktemp("tiny-qwen3"), cfg, seed=0)


@pytest.fixture(scope="module", params=list(FAMILIES))
def front(request, tiny):
    family = request.param
    fe = FrontEnd(str(tiny), grammar_workers=1, max_len=8192)  # one token a byte: long prompts
    fe.ctx.tokenizer = fe.tok = Tokenizer(tiny, str(real_template(family)))
    fe.ctx.limits = replace(fe.ctx.limits, tool_parser=FAMILIES[family][0])
    fe.family = family
    yield fe
    fe.close()


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)


@pytest.mark.parametrize("stream", [False, True])
def test_the_familys_calls_are_read_and_come_back_through_its_template(front, stream):
    parser, answer, rendered = FAMILIES[front.family]
    front.ring.script = front.tok.encode(answer, add_bos=False)
    kw = dict(model="m", messages=ASK, tools=[WEATHER, ALERT], max_tokens=len(front.ring.script))
    if stream:
        nine = parser == "mistral"
        ok = (lambda i: len(i) == 9 and i.isalnum()) if nine else (lambda i: i.startswith("call_"))
        _, calls, _ = _streamed(_client(front.url).chat.completions.create(stream=True, **kw), ok)
        ids = ["abcDEF123" if nine else "call_1"]  # (the whole answer's own ids go round the loop below)
    else:
        message = _client(front.url).chat.completions.create(**kw).choices[0].message
        calls = [(c.function.name, c.function.arguments) for c in message.tool_calls]
        ids = [c.id for c in message.tool_calls]
    assert [(n, json.loads(a)) for n, a in calls] == [("get_weather", {"city": "Oslo", "unit": "celsius"})]
    if parser == "mistral":
        assert all(len(i) == 9 and i.isalnum() for i in ids)  # what its template takes back
    call = {"id": ids[0], "type": "function", "function": {"name": calls[0][0], "arguments": calls[0][1]}}
    turns = ASK + [{"role": "assistant", "content": None, "tool_calls": [call]},
                   {"role": "tool", "tool_call_id": ids[0], "content": "-3 C, snow"}]  # fmt: skip
    r = httpx.post(f"{front.url}/tokenize", json={"messages": turns, "tools": [WEATHER, ALERT]}, timeout=30)
    assert r.status_code == 200, r.text
    text = front.tok.decode(r.json()["tokens"], skip_special_tokens=False)
    for piece in rendered:
        assert piece.replace("{id}", ids[0]) in text, (piece, text)
    front.ring.script = front.tok.encode("It snows in Oslo.", add_bos=False)
    reply = _client(front.url).chat.completions.create(model="m", messages=turns, tools=[WEATHER, ALERT],
                                                       max_tokens=len(front.ring.script))  # fmt: skip
    assert reply.choices[0].message.content == "It snows in Oslo."


def test_qwen3_enable_thinking_and_reasoning(front):
    if front.family != "qwen3":
        pytest.skip("Qwen3's template alone reads enable_thinking")
    r = httpx.post(f"{front.url}/tokenize", json={"messages": ASK, "chat_template_kwargs": {"enable_thinking": False}},
                   timeout=30)  # fmt: skip
    assert front.tok.decode(r.json()["tokens"], skip_special_tokens=False).endswith("<think>\n\n</think>\n\n")
    r = httpx.post(f"{front.url}/tokenize", json={"messages": ASK}, timeout=30)
    assert "<think>" not in front.tok.decode(r.json()["tokens"], skip_special_tokens=False)
    front.ctx.reasoning_parser = "qwen3"
    try:
        front.ring.script = front.tok.encode("<think>Oslo is cold.</think>It is cold.", add_bos=False)
        message = _client(front.url).chat.completions.create(model="m", messages=ASK,
                                                             max_tokens=len(front.ring.script)).choices[0].message
        assert (message.reasoning_content, message.content) == ("Oslo is cold.", "It is cold.")
    finally:
        front.ctx.reasoning_parser = None


def test_required_and_named_calls_on_a_real_ring(tiny):
    """A random model's calls, constrained by the grammar: schema-valid on every one of 20 requests (each ask
    `required` and by name, whole and streamed), with Qwen3's template and reasoning parser; its thinking turned
    off in the template, so the grammar applies from the first token."""
    args = ["--model", str(tiny), "--threads-per-stage", "1", "--kv-cache-memory", "32M", "--chat-template",
            str(real_template("qwen3")), "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
            "--reasoning-parser", "qwen3", "--served-model-name", "m"]  # fmt: skip
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, ALERT)}
    asks = ["Weather in Oslo?", "Tell me if it rains in Lima.", "Is it windy in Perth?", "Cairo, in fahrenheit.",
            "Alert me about snow in Bern.", "Weather for Quito", "Will it rain in Pune?", "Snow alert for Oslo",
            "How cold is Riga?", "Watch the wind in Wellington."]  # fmt: skip
    with ServerProcess(args) as srv:
        client = _client(srv.url)

        def one(i: int):
            named = {"type": "function", "function": {"name": ("get_weather", "set_alert")[i % 2]}}
            choice = "required" if i < 10 else named
            kw = dict(model="m", messages=[{"role": "user", "content": asks[i % 10]}], tools=[WEATHER, ALERT],
                      tool_choice=choice, max_tokens=96, temperature=0.7, seed=i, parallel_tool_calls=i % 3 != 0,
                      extra_body={"chat_template_kwargs": {"enable_thinking": False}})  # fmt: skip
            if i % 2:
                return _streamed(client.chat.completions.create(stream=True, **kw))[1:], choice
            msg = client.chat.completions.create(**kw).choices[0]
            return ([(c.function.name, c.function.arguments) for c in msg.message.tool_calls or []],
                    msg.finish_reason), choice  # fmt: skip

        with ThreadPoolExecutor(20) as pool:
            results = list(pool.map(one, range(20)))
    for (calls, finish), choice in results:
        assert calls and finish in ("tool_calls", "stop", "length"), (calls, finish, choice)
        for name, args in calls:
            assert choice == "required" or name == choice["function"]["name"], (name, choice)
            jsonschema.validate(json.loads(args), schemas[name])
