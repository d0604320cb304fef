"""`POST /v1/responses`, stateless: a Responses request is read as the chat request it stands for (`input` text or
items, `instructions`, function `tools`, `tool_choice`, `max_output_tokens`), served as one, and answered in the
Responses shapes: output items (`reasoning`, `message` with `output_text`, `function_call`), usage in input and
output tokens, and when streamed the typed events the `openai` client reads (`response.created`, ...,
`response.output_text.delta`, ..., `response.completed`). Nothing is stored: `previous_response_id` is refused.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from ringsched.server.errors import APIError, shown
from ringsched.server.protocol import Prepared, parse_chat
from ringsched.server.request_limits import Limits
from ringsched.tokenizer import Tokenizer

PASSED = ("model", "temperature", "top_p", "stream", "user", "metadata", "parallel_tool_calls", "seed")
REFUSED = {
    "previous_response_id": "this server keeps no responses: send the whole conversation as input",
    "background": "this server answers in the foreground only",
}


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise APIError(400, f"{where}: content is a text or a list of text parts", param="input")


def _messages(body: dict) -> list[dict]:
    given = body.get("input")
    messages = [{"role": "system", "content": body["instructions"]}] if body.get("instructions") else []
    if isinstance(given, str):
        return [*messages, {"role": "user", "content": given}]
    if not isinstance(given, list) or not given:
        raise APIError(400, "input is a text or a non-empty list of items", param="input")
    for i, item in enumerate(given):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            messages.append({"role": item.get("role"), "content": _text(item.get("content"), f"input[{i}]")})
        elif kind == "function_call":
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")},
            }
            if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls"):
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": item.get("output")})
        else:
            raise APIError(400, f"input[{i}]: items of type {shown(kind)} are not supported", param="input")
    return messages


def chat_body(body: dict) -> dict:
    """The chat request a Responses request stands for (a 400 naming the field it cannot be)."""
    for name, why in REFUSED.items():
        if body.get(name):
            raise APIError(400, f"{name}: {why}", param=name)
    chat = {k: body[k] for k in PASSED if k in body}
    chat["messages"] = _messages(body)
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    if body.get("tools"):
        chat["tools"] = [_tool(t, i) for i, t in enumerate(body["tools"])]
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function":
        chat["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
    elif choice is not None:
        chat["tool_choice"] = choice
    return chat


def _tool(t: Any, i: int) -> dict:
    if not isinstance(t, dict) or t.get("type") != "function":
        raise APIError(400, f"tools[{i}]: only function tools are supported", param=f"tools[{i}]")
    fields = {k: t[k] for k in ("name", "description", "parameters", "strict") if t.get(k) is not None}
    return {"type": "function", "function": fields}


def parse_responses(body: dict, tok: Tokenizer, limits: Limits) -> Prepared:
    return parse_chat(chat_body(body), tok, limits)


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def output_items(message: dict) -> list[dict]:
    """A chat answer's `message` (`chat_output.ChatAnswer.message`) as Responses output items."""
    items = []
    if message.get("reasoning_content"):
        items.append(
            {
                "type": "reasoning",
                "id": _id("rs"),
                "summary": [],
                "content": [{"type": "reasoning_text", "text": message["reasoning_content"]}],
            }
        )
    if message.get("content"):
        items.append(_message_item(message["content"]))
    for call in message.get("tool_calls") or []:
        items.append(
            {
                "type": "function_call",
                "id": _id("fc"),
                "call_id": call["id"],
                "status": "completed",
                "name": call["function"]["name"],
                "arguments": call["function"]["arguments"],
            }
        )
    return items


def _message_item(text: str, status: str = "completed") -> dict:
    return {
        "type": "message",
        "id": _id("msg"),
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }


def response(
    rid: str,
    model: str,
    body_req: Prepared,
    output: list[dict],
    usage: dict | None,
    finish: str | None,
    status: str = "completed",
) -> dict:
    cut = finish == "length" and status == "completed"
    return {
        "id": rid,
        "object": "response",
        "created_at": int(time.time()),
        "model": model,
        "status": "incomplete" if cut else status,
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "output": output,
        "parallel_tool_calls": body_req.tools.parallel if body_req.tools else True,
        "tool_choice": body_req.tools.choice if body_req.tools else "none",
        "tools": [{"type": "function", **t["function"]} for t in body_req.tools.tools] if body_req.tools else [],
        "usage": usage,
        "error": None,
        "instructions": None,
        "metadata": None,
        "temperature": None,
        "top_p": None,
    }


def responses_usage(every: dict) -> dict:
    return {
        "input_tokens": every["prompt_tokens"],
        "output_tokens": every["completion_tokens"],
        "total_tokens": every["total_tokens"],
        "input_tokens_details": {"cached_tokens": every["prompt_tokens_details"]["cached_tokens"]},
        "output_tokens_details": {"reasoning_tokens": 0},
    }


class _Sequence:
    """Numbers a stream's events in order (`sequence_number`)."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self, kind: str, **fields) -> dict:
        self.n += 1
        return {"type": kind, "sequence_number": self.n - 1, **fields}


async def stream_events(
    rid: str, model: str, req: Prepared, pieces: AsyncIterator[tuple[list[dict], bool]], final: dict
) -> AsyncIterator[dict]:
    """The Responses events of one streamed answer: `pieces` gives each step's chat deltas (`ChatAnswer`) and
    whether the answer ended; `final` is filled by then with the whole `message`, usage and finish reason."""
    event = _Sequence()
    yield event("response.created", response=response(rid, model, req, [], None, None, "in_progress"))
    yield event("response.in_progress", response=response(rid, model, req, [], None, None, "in_progress"))
    item, text = None, ""
    async for deltas, _ in pieces:
        for d in deltas:
            if not d.get("content"):
                continue
            if item is None:
                item = {**_message_item("", "in_progress"), "content": []}
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                yield event("response.output_item.added", output_index=0, item=item)
                yield event(
                    "response.content_part.added", item_id=item["id"], output_index=0, content_index=0, part=part
                )
            text += d["content"]
            yield event(
                "response.output_text.delta",
                item_id=item["id"],
                output_index=0,
                content_index=0,
                delta=d["content"],
                logprobs=[],
            )
    output = output_items(final["message"])
    for e in _closing(event, item, text, output):  # `output`'s message becomes the streamed one
        yield e
    done = response(rid, model, req, output, final["usage"], final["finish"])
    yield event("response.completed" if done["status"] == "completed" else "response.incomplete", response=done)


def _closing(event: _Sequence, item: dict | None, text: str, output: list[dict]) -> list[dict]:
    """The events that close the streamed text's item, then the other items' (reasoning, calls)."""
    events = []
    if item is not None:
        done = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        ids = {"item_id": item["id"], "output_index": 0, "content_index": 0}
        events.append(event("response.output_text.done", **ids, text=text, logprobs=[]))
        events.append(event("response.content_part.done", **ids, part=done))
        whole = {**item, "status": "completed", "content": [done]}
        events.append(event("response.output_item.done", output_index=0, item=whole))
        output[:] = [whole if o["type"] == "message" else o for o in output]
    for k, o in enumerate(output):
        if o["type"] != "message" or item is None:
            events.append(event("response.output_item.added", output_index=k, item=o))
            events.append(event("response.output_item.done", output_index=k, item=o))
    return events


# -- the endpoint ------------------------------------------------------------------------------------------------
async def serve_responses(request, ctx) -> object:
    """`/v1/responses`: the request served as its chat request, answered in the Responses shapes."""
    from ringsched.server.chat_output import ChatAnswer
    from ringsched.server.endpoints import _serve

    def answer(req: Prepared) -> ChatAnswer:
        return ChatAnswer(ctx.reasoning_parser, req.tools, ctx.limits.tool_parser)

    def events(rid: str, deltas: list, req: Prepared) -> AsyncIterator[dict]:
        final: dict = {}
        return stream_events(rid, ctx.model_name, req, _pieces(deltas[0], answer(req), answer(req), final), final)

    def whole(rid: str, results: list, every: dict, req: Prepared) -> dict:
        text, last = results[0]
        message, finish = answer(req).message(text, last.finish_reason)
        return response(rid, ctx.model_name, req, output_items(message), responses_usage(every), finish)

    return await _serve(request, ctx, parse_responses, "resp", events, whole)


async def _pieces(deltas: AsyncIterator, streamed, whole, final: dict) -> AsyncIterator[tuple[list[dict], bool]]:
    """Each step's chat deltas from `streamed` (a `ChatAnswer`); at the end `final` gets the whole answer's message
    (from `whole`, a second `ChatAnswer`), finish reason and usage."""
    from ringsched.server.choices import combined_usage

    text, last = "", None
    async for d in deltas:
        text, last = text + d.text, d
        yield streamed.feed(d.text), False
        if d.finish_reason:
            yield streamed.finish(d.finish_reason)[0], True
    message, finish = whole.message(text, last.finish_reason if last else None)
    final.update(message=message, finish=finish, usage=responses_usage(combined_usage([last])) if last else None)
