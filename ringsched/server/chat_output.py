"""One sequence's chat answer as the client reads it: the reasoning apart (`--reasoning-parser`), then the tool calls
found in the rest (`tools.py`, `tool_parsers.py`), whole (`message`) or streamed (`feed`, `finish`: the deltas of
OpenAI's stream, `delta.reasoning_content`, `delta.content`, `delta.tool_calls` with index, id, name and
arguments)."""

from __future__ import annotations

from ringsched.server.reasoning import ReasoningSplit, split_whole
from ringsched.server.tool_parsers import PARSERS, Parsed, StreamedCalls, openai_call_id
from ringsched.server.tools import ToolUse


class ChatAnswer:
    def __init__(self, reasoning_parser: str | None, tools: ToolUse | None, tool_parser: str | None) -> None:
        self.reasoning_parser = reasoning_parser
        self.tools = tools if tools is not None and tools.choice != "none" else None
        self.parser = PARSERS[tool_parser]() if self.tools is not None and tool_parser else None
        self.call_id = self.parser.call_id if self.parser else openai_call_id
        self.split = ReasoningSplit(reasoning_parser) if reasoning_parser else None
        self.calls = StreamedCalls(self.parser) if self.tools is not None and not self.tools.constrained else None
        self.held = ""  # a constrained answer's text, parsed at the end
        self.cut = False  # the constrained answer did not parse whole: max_tokens cut it

    # -- whole ---------------------------------------------------------------------------------------------------
    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The `message` of a whole answer, and its finish reason (`tool_calls` when it called)."""
        reasoning, content = split_whole(self.reasoning_parser, text) if self.reasoning_parser else (None, text)
        found = self._found(content)
        message: dict = {"role": "assistant", "content": found.content}
        if self.reasoning_parser:
            message["reasoning_content"] = reasoning
        if found.calls:
            message["tool_calls"] = [
                {"id": self.call_id(), "type": "function", "function": {"name": n, "arguments": a}}
                for n, a in found.calls
            ]
            finish_reason = self._finish(finish_reason)
        return message, finish_reason

    def _found(self, content: str) -> Parsed:
        if self.tools is None:
            return Parsed(content)
        if self.tools.constrained:
            calls, self.cut = self.tools.constrained_calls(content)
            return Parsed(None, calls) if calls else Parsed(content)
        return self.parser.parse(content)

    def _finish(self, finish_reason: str | None) -> str | None:
        """A named function ends as OpenAI's do (`stop`); `required` and `auto` calls end with `tool_calls`, unless
        max_tokens cut a constrained answer (`length`: the calls are those complete before the cut)."""
        if self.cut:
            return finish_reason
        return finish_reason if self.tools.choice == "named" else "tool_calls"

    # -- streamed ------------------------------------------------------------------------------------------------
    def feed(self, piece: str) -> list[dict]:
        reasoning, content = self.split.feed(piece) if self.split else ("", piece)
        return self._deltas(reasoning, content)

    def finish(self, finish_reason: str | None) -> tuple[list[dict], str | None]:
        """What was held back, and the finish reason."""
        deltas = self._deltas(*self.split.finish()) if self.split else []
        if self.tools is None:
            return deltas, finish_reason
        found = self._found(self.held) if self.tools.constrained else self.calls.finish()
        if self.tools.constrained and not found.calls and self.held:
            found = Parsed(self.held)
        if found.content:
            deltas.append({"content": found.content})
        for k, (name, args) in enumerate(found.calls):
            deltas.append(
                {
                    "tool_calls": [
                        {
                            "index": k,
                            "id": self.call_id(),
                            "type": "function",
                            "function": {"name": name, "arguments": ""},
                        }
                    ]
                }
            )
            deltas.append({"tool_calls": [{"index": k, "function": {"arguments": args}}]})
        return deltas, self._finish(finish_reason) if found.calls else finish_reason

    def _deltas(self, reasoning: str, content: str) -> list[dict]:
        out = [{"reasoning_content": reasoning}] if reasoning else []
        if content and self.tools is not None:
            if self.tools.constrained:
                self.held += content
                content = ""
            else:
                content = self.calls.feed(content)
        return out + ([{"content": content}] if content else [])
