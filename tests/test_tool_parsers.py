"""`--tool-call-parser` (`server/tool_parsers.py`): each parser's whole texts, and every text streamed split at every
character gives the same content and calls (content streamed is never part of a call)."""

from __future__ import annotations

import json

import pytest

from ringsched.server.tool_parsers import PARSERS, StreamedCalls

W = {"city": "Oslo", "unit": "celsius"}
CASES = [
    # parser, text, content, [(name, arguments)]
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n'
               "</tool_call>", "Let me check.", [("weather", W)]),
    ("hermes", '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", "arguments": '
               '{"x": [1, 2]}}</tool_call>', None, [("a", {}), ("b", {"x": [1, 2]})]),
    ("hermes", "No tools needed: 2 < 3 and <tool is not a tag.", "No tools needed: 2 < 3 and <tool is not a tag.", []),
    ("hermes", '<tool_call>{"name": "weather", "arguments": {"city": "Os', '<tool_call>{"name": "weather", '
               '"arguments": {"city": "Os', []),  # cut off: stays text
    ("llama3_json", '{"name": "weather", "parameters": {"city": "Oslo", "unit": "celsius"}}', None, [("weather", W)]),
    ("llama3_json", '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"y": true}}', None,
     [("a", {}), ("b", {"y": True})]),
    ("llama3_json", "The weather in Oslo is {cold}.", "The weather in Oslo is {cold}.", []),
    ("llama3_json", "{not json}", "{not json}", []),
    ("mistral", 'Sure. [TOOL_CALLS][{"name": "weather", "arguments": {"city": "Oslo", "unit": "celsius"}}]', "Sure.",
     [("weather", W)]),
    ("mistral", "[TOOL_CALLS] not a list", "[TOOL_CALLS] not a list", []),
    ("pythonic", '[weather(city="Oslo", unit="celsius"), now()]', None, [("weather", W), ("now", {})]),
    ("pythonic", "[1, 2, 3] are numbers", "[1, 2, 3] are numbers", []),
    ("pythonic", '[os.system("rm -rf /")]', '[os.system("rm -rf /")]', []),
    ("pythonic", "Plain answer.", "Plain answer.", []),
]  # fmt: skip


def _calls(parsed) -> list:
    return [(name, json.loads(args)) for name, args in parsed.calls]


@pytest.mark.parametrize("parser, text, content, calls", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_whole_and_streamed_at_every_split(parser, text, content, calls):
    p = PARSERS[parser]()
    whole = p.parse(text)
    assert (whole.content, _calls(whole)) == (content, calls)
    for cut in [*range(len(text) + 1), None]:  # None: one character at a time
        s = StreamedCalls(p)
        pieces = [text[:cut], text[cut:]] if cut is not None else list(text)
        streamed = "".join(s.feed(piece) for piece in pieces)
        end = s.finish()
        assert _calls(end) == calls, cut
        joined = (streamed + (end.content or "")) if not calls else streamed
        want = text if not calls else (content or "")
        assert joined.strip() == want.strip(), (cut, streamed, end)
        assert not calls or (end.content is None and streamed.strip() == (content or "")), cut
