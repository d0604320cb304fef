"""`/v1/responses` (stateless) with the `openai` client over real HTTP (the app over a fake ring answering a scripted
text): text in and out, whole and streamed; instructions and item input reach the template as chat messages; a
function call comes back as a `function_call` item; what needs stored state is refused naming the field."""

from __future__ import annotations

import json
from dataclasses import replace

import openai
import pytest
from fake_ring import FrontEnd
from test_tool_calls import TEMPLATE

from ringsched.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def front(smollm2_dir):
    fe = FrontEnd(str(smollm2_dir), grammar_workers=1)
    fe.ctx.tokenizer = fe.tok = Tokenizer(smollm2_dir, TEMPLATE)
    fe.ctx.limits = replace(fe.ctx.limits, tool_parser="hermes")
    yield fe
    fe.close()


def _answer(front, text: str) -> int:
    front.ring.script = front.tok.encode(text, add_bos=False)
    return len(front.ring.script)


def test_text_whole_and_streamed(front):
    n = _answer(front, "Oslo is the capital of Norway.")
    client = openai.OpenAI(base_url=f"{front.url}/v1", api_key="x")
    r = client.responses.create(model="m", input="Capital of Norway?", instructions="Be brief.", max_output_tokens=n)
    assert r.output_text == "Oslo is the capital of Norway." and r.status == "incomplete"  # it stopped at the limit
    assert r.usage.output_tokens == n and r.usage.input_tokens > 0
    events = list(client.responses.create(model="m", input="Capital of Norway?", max_output_tokens=n, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == "Oslo is the capital of Norway."
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].response.output[0].content[0].text == "Oslo is the capital of Norway."


def test_a_function_call_round_trip(front):
    n = _answer(front, '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>')
    client = openai.OpenAI(base_url=f"{front.url}/v1", api_key="x")
    tool = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}}}  # fmt: skip
    r = client.responses.create(model="m", input="Weather in Oslo?", tools=[tool], max_output_tokens=n)
    call = next(o for o in r.output if o.type == "function_call")
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Oslo"}
    n = _answer(front, "Snowy, -3 C.")
    follow = [{"role": "user", "content": "Weather in Oslo?"},
              {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
              {"type": "function_call_output", "call_id": call.call_id, "output": "-3 C, snow"}]  # fmt: skip
    r = client.responses.create(model="m", input=follow, tools=[tool], max_output_tokens=n)
    assert r.output_text == "Snowy, -3 C."


def test_stored_state_is_refused_naming_the_field(front):
    client = openai.OpenAI(base_url=f"{front.url}/v1", api_key="x")
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="m", input="hi", previous_response_id="resp_1")
    assert e.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="m", input=[{"type": "web_search_call"}])
    assert e.value.body["param"] == "input"
