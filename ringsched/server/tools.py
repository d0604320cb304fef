"""Tool calling on `/v1/chat/completions`: the request's `tools` and `tool_choice`, checked and turned into what the
template, the grammar engine and the answer need (`ToolUse`).

- The tools reach the chat template as `tools` (transformers' shape: `{"type": "function", "function": {...}}`),
  and earlier turns' `tool_calls` (arguments as objects) and `tool` messages' `tool_call_id` reach it too.
- `required` and a named function are constrained by the grammar engine to the functions' JSON schemas, so their
  calls always parse: `required` to a JSON array of `{"name", "parameters"}` (one item unless
  `parallel_tool_calls`), a named function to its arguments object (vLLM's forms).
- `auto` is parsed after the fact by the server's `--tool-call-parser` (`tool_parsers.py`); a malformed call
  stays text. `none` passes the tools to the template and parses nothing.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from ringsched.server.errors import APIError, shown
from ringsched.server.grammar_request import Asked
from ringsched.server.request_bodies import ChatRequest

NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class ToolUse:
    tools: list[dict]  # for the template
    choice: str  # none, auto, required, or "named"
    named: str | None = None
    parallel: bool = True

    @property
    def constrained(self) -> bool:
        return self.choice in ("required", "named")

    def grammar(self) -> Asked | None:
        """The constraint of `required` or a named function, or None."""
        if not self.constrained:
            return None
        schemas = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in self.tools}
        if self.choice == "named":
            return Asked("tool_choice", {"json_schema": schemas[self.named]})
        item = {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"name": {"const": name}, "parameters": schema},
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
                for name, schema in schemas.items()
            ]
        }
        array = {"type": "array", "items": item, "minItems": 1, **({} if self.parallel else {"maxItems": 1})}
        return Asked("tool_choice", {"json_schema": array})

    def constrained_calls(self, text: str) -> tuple[list[tuple[str, str]] | None, bool]:
        """The calls in a constrained answer, or None when it does not parse (cut off by max_tokens): of `required`
        calls cut off, the complete ones before the cut; and whether it was cut."""
        try:
            return self._calls(json.loads(text)), False
        except ValueError:
            found = _whole_items(text) if self.choice == "required" else None
            return (self._calls(found) if found else None), True

    def _calls(self, found: object) -> list[tuple[str, str]] | None:
        if self.choice == "named":
            return [(self.named, json.dumps(found, ensure_ascii=False))] if isinstance(found, dict) else None
        if not isinstance(found, list) or not all(isinstance(c, dict) and "name" in c for c in found):
            return None
        return [(c["name"], json.dumps(c.get("parameters", {}), ensure_ascii=False)) for c in found]


def _whole_items(text: str) -> list:
    """The complete items at the start of a JSON array cut short."""
    decoder, items = json.JSONDecoder(), []
    at = text.find("[") + 1
    while at > 0:
        while at < len(text) and text[at] in " \t\n\r,":
            at += 1
        try:
            item, at = decoder.raw_decode(text, at)
        except ValueError:
            break
        items.append(item)
    return items


def tool_use(fields: ChatRequest, parser: str | None) -> ToolUse | None:
    """The request's tools, checked (a 400 naming the field), or None without tools."""
    choice = fields.tool_choice
    if not fields.tools:
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        return None
    tools = [t.model_dump(exclude_none=True) for t in fields.tools]
    names = [t["function"]["name"] for t in tools]
    for i, t in enumerate(tools):
        name, params = t["function"]["name"], t["function"].get("parameters")
        if not NAME.match(name) or names.index(name) != i:
            why = "is used twice" if NAME.match(name) else "must be 1 to 64 letters, digits, _, . or -"
            raise APIError(400, f"tools[{i}].function.name {shown(name)} {why}", param=f"tools[{i}].function.name")
        if params is not None and params.get("type", "object") != "object":
            raise APIError(
                400,
                f"tools[{i}].function.parameters must be a JSON schema of an object",
                param=f"tools[{i}].function.parameters",
            )
    named = None
    if isinstance(choice, dict):
        named = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if named not in names:
            raise APIError(400, f"tool_choice names no function of tools: {shown(choice)}", param="tool_choice")
        choice = "named"
    choice = choice or "auto"
    if choice not in (*CHOICES, "named"):
        raise APIError(400, f"tool_choice {shown(choice)}: use none, auto, required or a function", param="tool_choice")
    if choice == "auto" and parser is None:
        raise APIError(
            400,
            "tool_choice auto (the default with tools) needs the server's --enable-auto-tool-choice and "
            "--tool-call-parser; or give tool_choice required, a function, or none",
            param="tool_choice",
        )
    return ToolUse(tools, choice, named, fields.parallel_tool_calls)


def template_messages(messages: list[dict], raw: list[Any]) -> list[dict]:
    """`messages` (role and text) with each earlier turn's `tool_calls` (arguments as objects, as templates expect
    them) and `tool_call_id`, from the request's messages `raw`."""
    out = []
    for i, (m, r) in enumerate(zip(messages, raw, strict=True)):
        m = dict(m)
        if getattr(r, "tool_calls", None):
            calls = []
            for j, c in enumerate(r.tool_calls):
                try:
                    args = json.loads(c.function.arguments or "{}")
                except ValueError:
                    raise APIError(
                        400,
                        f"messages[{i}].tool_calls[{j}].function.arguments is not JSON",
                        param=f"messages[{i}].tool_calls",
                    ) from None
                calls.append({"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": args}})
            m["tool_calls"] = calls
        if getattr(r, "tool_call_id", None) is not None:
            m["tool_call_id"] = r.tool_call_id
        if getattr(r, "name", None) is not None:
            m["name"] = r.name
        out.append(m)
    return out
