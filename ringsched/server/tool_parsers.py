"""`--tool-call-parser`: the tool calls in a model's text, for `tool_choice: auto` (vLLM's parser names).

- `hermes` (Qwen2.5, Qwen3, Hermes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks; the text
  before the first block is the content.
- `llama3_json` (Llama 3.1-3.3): the answer is one JSON object `{"name": ..., "parameters": {...}}` (or several
  joined by `;`), after an optional `<|python_tag|>`.
- `mistral`: `[TOOL_CALLS]` then a JSON array of `{"name": ..., "arguments": {...}}`; the text before is content;
  call ids of 9 letters and digits (Mistral's templates refuse others when the call comes back).
- `pythonic` (Llama 4, some small models): the answer is a Python list of calls, `[get_weather(city="Oslo")]`,
  literal arguments only (read with `ast`, never run).

Each parser reads a whole text into `Parsed(content, calls)`; a text whose calls do not parse stays content (a
malformed call is text, as in vLLM). A stream is held back from where a call may begin (`Parser.opens`), so what
streams as content is never part of a call, and the held text is parsed whole when the sequence ends.
"""

from __future__ import annotations

import ast
import json
import re
import secrets
import string
import uuid
from dataclasses import dataclass, field


@dataclass
class Parsed:
    content: str | None
    calls: list[tuple[str, str]] = field(default_factory=list)  # (function name, arguments as JSON text)


def _call(obj: object, args_key: tuple[str, ...] = ("arguments", "parameters")) -> tuple[str, str]:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ValueError("a call is an object with a name")
    args = next((obj[k] for k in args_key if k in obj), {})
    if isinstance(args, str):
        args = json.loads(args)
    if not isinstance(args, dict):
        raise ValueError("a call's arguments are an object")
    return obj["name"], json.dumps(args, ensure_ascii=False)


def openai_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def nine_char_call_id() -> str:
    """Mistral's templates refuse any tool call id but 9 letters and digits."""
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


class Parser:
    """`opens(text)`: where in `text` a call may begin (its index; len(text) when none may); `parse(text)`;
    `call_id()`: a new call's id, in the form the family's chat template takes back."""

    marker = ""
    call_id = staticmethod(openai_call_id)

    def opens(self, text: str) -> int:
        at = text.find(self.marker)
        if at >= 0:
            return at
        for n in range(min(len(self.marker) - 1, len(text)), 0, -1):  # the marker's start at the end: hold it
            if self.marker.startswith(text[-n:]):
                return len(text) - n
        return len(text)

    def parse(self, text: str) -> Parsed:
        raise NotImplementedError


class Hermes(Parser):
    marker = "<tool_call>"
    _BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)

    def parse(self, text: str) -> Parsed:
        at = text.find(self.marker)
        if at < 0:
            return Parsed(text)
        try:
            calls = [_call(json.loads(body)) for body in self._BLOCK.findall(text[at:]) if body.strip()]
        except ValueError:
            return Parsed(text)
        return Parsed(text[:at].strip() or None, calls) if calls else Parsed(text)


class Mistral(Parser):
    call_id = staticmethod(nine_char_call_id)
    marker = "[TOOL_CALLS]"

    def parse(self, text: str) -> Parsed:
        at = text.find(self.marker)
        if at < 0:
            return Parsed(text)
        try:
            found = json.loads(text[at + len(self.marker) :].strip())
            calls = [_call(c) for c in (found if isinstance(found, list) else [found])]
        except ValueError:
            return Parsed(text)
        return Parsed(text[:at].strip() or None, calls) if calls else Parsed(text)


class _Leading(Parser):
    """Calls that are the whole answer: a call may begin only at its first non-blank character."""

    starts: tuple[str, ...] = ()

    def opens(self, text: str) -> int:
        body = text.lstrip()
        if not body:
            return 0  # nothing but blanks yet: hold them
        may = any(s.startswith(body[: len(s)]) or body.startswith(s) for s in self.starts)
        return 0 if may else len(text)


class Llama3Json(_Leading):
    starts = ("{", "<|python_tag|>")

    def parse(self, text: str) -> Parsed:
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return Parsed(text)
        try:
            decoder, calls, at = json.JSONDecoder(), [], 0
            while at < len(body):
                obj, end = decoder.raw_decode(body, at)
                calls.append(_call(obj, ("parameters", "arguments")))
                at = end
                while at < len(body) and body[at] in " \n\t;":
                    at += 1
        except ValueError:
            return Parsed(text)
        return Parsed(None, calls)


class Pythonic(_Leading):
    starts = ("[",)

    def parse(self, text: str) -> Parsed:
        body = text.strip()
        try:
            tree = ast.parse(body, mode="eval").body
            if not isinstance(tree, ast.List) or not tree.elts:
                return Parsed(text)
            calls = []
            for node in tree.elts:
                if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                    return Parsed(text)
                args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
                calls.append((node.func.id, json.dumps(args, ensure_ascii=False)))
        except (SyntaxError, ValueError, TypeError):
            return Parsed(text)
        return Parsed(None, calls)


class StreamedCalls:
    """One streamed sequence through a parser: `feed(piece)` gives the content to send now (never part of a call);
    `finish()` gives (content, calls) of what was held back."""

    def __init__(self, parser: Parser) -> None:
        self.parser, self.text, self.sent, self.spoke = parser, "", 0, False

    def feed(self, piece: str) -> str:
        self.text += piece
        unsent = self.text[self.sent :]
        leading_over = isinstance(self.parser, _Leading) and self.spoke
        at = len(unsent) if leading_over else self.parser.opens(unsent)
        self.sent += at
        self.spoke = self.spoke or bool(unsent[:at].strip())
        return unsent[:at]

    def finish(self) -> Parsed:
        held, self.sent = self.text[self.sent :], len(self.text)
        if not held:
            return Parsed(None)
        found = self.parser.parse(held)
        return found if found.calls else Parsed(held)


PARSERS: dict[str, type[Parser]] = {
    "hermes": Hermes,
    "llama3_json": Llama3Json,
    "mistral": Mistral,
    "pythonic": Pythonic,
}
