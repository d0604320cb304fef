"""Tool calling over real HTTP with the `openai` client (the app over a fake ring that answers a scripted text):
`auto` read by the hermes parser, `required` and a named function turned into calls from the constrained JSON
(the grammar is proven as any structured output's), whole and streamed; tools and earlier turns' calls reach the
chat template; bad tools are a 400 naming the field."""

from __future__ import annotations

import json
from dataclasses import replace

import openai
import pytest
from fake_ring import FrontEnd

from ringsched.tokenizer import Tokenizer

TEMPLATE = """{%- if tools %}<|im_start|>system
You can call: {% for t in tools %}{{ t.function.name }}{{ t.function.parameters | tojson }} {% endfor %}
Call as <tool_call>{"name": ..., "arguments": {...}}</tool_call>.<|im_end|>
{% endif %}
{%- for m in messages %}<|im_start|>{{ m.role }}
{%- if m.tool_calls %}{% for c in m.tool_calls %}
<tool_call>{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}</tool_call>
{%- endfor %}{% elif m.role == "tool" %}
<tool_response id="{{ m.tool_call_id }}">{{ m.content }}</tool_response>
{%- else %}
{{ m.content }}{% endif %}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "Weather in Oslo?"}]


@pytest.fixture(scope="module")
def front(smollm2_dir):
    fe = FrontEnd(str(smollm2_dir), grammar_workers=1)
    fe.ctx.tokenizer = Tokenizer(smollm2_dir, TEMPLATE)
    fe.ctx.limits = replace(fe.ctx.limits, tool_parser="hermes")
    fe.tok = fe.ctx.tokenizer
    yield fe
    fe.close()


def _answer(front, text: str) -> int:
    front.ring.script = front.tok.encode(text, add_bos=False)
    return len(front.ring.script)


def _streamed(stream, id_ok=lambda i: i.startswith("call_")) -> tuple[str, list[tuple[str, str]], str | None]:
    """Content, the calls assembled from `delta.tool_calls` pieces by index (each id passing `id_ok`), and the
    finish reason."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for piece in choice.delta.tool_calls or []:
                call = calls.setdefault(piece.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = piece.id or call["id"]
                call["name"] += piece.function.name or "" if piece.function else ""
                call["arguments"] += piece.function.arguments or "" if piece.function else ""
            finish = choice.finish_reason or finish
    assert all(c["id"] and id_ok(c["id"]) for c in calls.values())
    return content, [(c["name"], c["arguments"]) for _, c in sorted(calls.items())], finish


def _ask(front, stream: bool, **kw) -> tuple[str | None, list[tuple[str, str]], str | None]:
    """ASK with `kw` through the openai client: content, calls (name, arguments) and finish reason."""
    client = openai.OpenAI(base_url=f"{front.url}/v1", api_key="x")
    if stream:
        return _streamed(client.chat.completions.create(model="m", messages=ASK, stream=True, **kw))
    choice = client.chat.completions.create(model="m", messages=ASK, **kw).choices[0]
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    return choice.message.content, calls, choice.finish_reason


@pytest.mark.parametrize("stream", [False, True])
def test_auto_reads_the_hermes_calls(front, stream):
    n = _answer(front, 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
    content, calls, finish = _ask(front, stream, tools=[WEATHER, TIME], max_tokens=n)
    assert content.strip() == "Checking." and finish == "tool_calls"
    assert [(name, json.loads(args)) for name, args in calls] == [("get_weather", {"city": "Oslo"})]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_required_and_named_calls_come_from_the_constrained_json(front, choice, stream):
    if choice == "required":
        n = _answer(front, '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "get_time", '
                           '"parameters": {}}]')  # fmt: skip
        tool_choice, want = "required", [("get_weather", {"city": "Oslo"}), ("get_time", {})]
    else:
        n = _answer(front, '{"city": "Oslo"}')
        tool_choice = {"type": "function", "function": {"name": "get_weather"}}
        want = [("get_weather", {"city": "Oslo"})]
    content, calls, finish = _ask(front, stream, tools=[WEATHER, TIME], tool_choice=tool_choice, max_tokens=n)
    assert not content and [(name, json.loads(args)) for name, args in calls] == want
    assert finish == ("tool_calls" if choice == "required" else "length")  # named: as the sequence ended


@pytest.mark.parametrize("stream", [False, True])
def test_required_calls_cut_by_max_tokens_keep_the_complete_ones(front, stream):
    """A small model may add calls until max_tokens: the complete calls before the cut, finish reason `length`."""
    text = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "get_time", "parameters": {}}, '
    n = _answer(front, text + '{"name": "get_weather", "parameters": {"city": "Osl')
    content, calls, finish = _ask(front, stream, tools=[WEATHER, TIME], tool_choice="required", max_tokens=n)
    assert not content and finish == "length"
    assert [(name, json.loads(args)) for name, args in calls] == [("get_weather", {"city": "Oslo"}), ("get_time", {})]


def test_a_two_turn_loop_renders_the_call_and_its_result_through_the_template(front):
    import httpx

    turns = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "-3 C, snow"},
    ]  # fmt: skip
    ids = httpx.post(f"{front.url}/tokenize", json={"messages": turns, "tools": [WEATHER]}, timeout=10).json()["tokens"]
    text = front.tok.decode(ids, skip_special_tokens=False)
    assert 'You can call: get_weather{"type": "object"' in text  # /tokenize renders the tools as a chat request does
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>' in text
    assert '<tool_response id="call_1">-3 C, snow</tool_response>' in text
    n = _answer(front, "It is -3 C with snow in Oslo.")
    client = openai.OpenAI(base_url=f"{front.url}/v1", api_key="x")
    answer = client.chat.completions.create(model="m", messages=turns, tools=[WEATHER], max_tokens=n)
    assert answer.choices[0].message.content == "It is -3 C with snow in Oslo."
    assert not answer.choices[0].message.tool_calls


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
         "tools[0].function.parameters"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
         "response_format"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                        "function": {"name": "f", "arguments": "{nope"}}]}]}, "messages[0].tool_calls"),
    ],
)  # fmt: skip
def test_bad_tools_are_a_400_naming_the_field(front, extra, param):
    client = openai.OpenAI(base_url=f"{front.url}/v1", api_key="x")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**{"model": "m", "messages": ASK, "max_tokens": 4, **extra})
    assert e.value.body["param"] == param, e.value.body


# -- on a real ring (run on test_server.py's server: SmolLM2 with tests/templates/smollm2_tools.jinja) ----------
RING_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                         "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "convert", "description": "Convert an amount between currencies",
     "parameters": {"type": "object", "properties": {"amount": {"type": "number"},
                                                     "from": {"type": "string", "maxLength": 8},
                                                     "to": {"type": "string", "maxLength": 8}},
                    "required": ["amount", "from", "to"], "additionalProperties": False}}},
]  # fmt: skip
RING_ASKS = ["What's the weather in Oslo?", "Is it raining in Lima right now?", "How warm is Cairo today?",
             "Convert 25 dollars to euros.", "How many yen is 300 pounds?", "Weather for Reykjavik, in fahrenheit.",
             "I need 12.5 CHF in USD.", "Should I take an umbrella in Seattle?", "Turn 1000 rupees into dollars.",
             "What's it like outside in Nairobi?"]  # fmt: skip


def check_real_ring(client: openai.OpenAI, url: str, headers: dict, model: str) -> None:
    """20 varied requests (10 asks, `required` and each tool by name, whole and streamed, parallel calls (a small
    model may add calls until max_tokens: the complete ones come back) or one)
    all end in calls whose arguments are valid under their tool's schema; a two-turn loop renders the model's own
    call and the tool's result through the template and is answered."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    import jsonschema

    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in RING_TOOLS}

    def one(i: int) -> tuple[list[tuple[str, str]], str | None, str | dict]:
        named = RING_TOOLS[i % 2]["function"]["name"]
        choice = "required" if i < 10 else {"type": "function", "function": {"name": named}}
        kw = dict(model=model, messages=[{"role": "user", "content": RING_ASKS[i % 10]}], tools=RING_TOOLS,
                  tool_choice=choice, max_tokens=128, temperature=0, parallel_tool_calls=i % 5 == 0)  # fmt: skip
        if i % 2:
            _, calls, finish = _streamed(client.chat.completions.create(stream=True, **kw))
        else:
            msg = client.chat.completions.create(**kw).choices[0]
            calls, finish = [(c.function.name, c.function.arguments) for c in msg.message.tool_calls or []], None
            finish = msg.finish_reason
        return calls, finish, choice

    with ThreadPoolExecutor(20) as pool:
        results = list(pool.map(one, range(20)))
    for calls, finish, choice in results:
        assert calls and finish in ("tool_calls", "stop", "length"), (calls, finish, choice)
        for name, args in calls:
            assert name in schemas and (choice == "required" or name == choice["function"]["name"]), (name, choice)
            jsonschema.validate(json.loads(args), schemas[name])

    ask = [{"role": "user", "content": RING_ASKS[0]}]
    first = client.chat.completions.create(model=model, messages=ask, tools=RING_TOOLS, tool_choice="required",
                                           max_tokens=256, temperature=0).choices[0].message  # fmt: skip
    call = first.tool_calls[0]
    turns = ask + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                   {"role": "tool", "tool_call_id": call.id, "content": "-3 C, snow"}]  # fmt: skip
    r = httpx.post(f"{url}/tokenize", json={"messages": turns, "tools": RING_TOOLS}, headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    ids = r.json()["tokens"]
    rendered = httpx.post(f"{url}/detokenize", json={"tokens": ids}, headers=headers, timeout=30).json()["prompt"]
    name, args = call.function.name, call.function.arguments
    assert f'<tool_call>{{"name": "{name}", "arguments": {args}}}</tool_call>' in rendered
    assert "<tool_response>-3 C, snow</tool_response>" in rendered and '"name": "convert"' in rendered
    answer = client.chat.completions.create(model=model, messages=turns, tools=RING_TOOLS, max_tokens=24,
                                            temperature=0).choices[0]  # fmt: skip
    assert answer.finish_reason in ("stop", "length", "tool_calls")
    assert answer.message.content or answer.message.tool_calls
