"""The generation endpoints: `/v1/completions`, `/v1/chat/completions` (OpenAI) and `/generate` (SGLang).

Each handler validates (protocol.py), admits (503 when shutting down, unhealthy or the waiting queue is full),
then either streams server-sent events or waits for the whole text. A non-streaming request whose client goes
away is aborted too: `until_disconnect` polls the connection while the request runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ringsched.server.engine_client import EngineError
from ringsched.server.protocol import APIError, Prepared, load_json, parse_chat, parse_completion, parse_generate
from ringsched.server.serving import Delta, ServerContext, collect, sse, text_deltas, usage

T = TypeVar("T")
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def admit(ctx: ServerContext) -> None:
    client = ctx.client
    if not client.healthy:
        raise APIError(503, f"the engine is not available: {client.failure}", "service_unavailable_error")
    if not client.accepting:
        raise APIError(503, "the server is shutting down", "service_unavailable_error")
    limit = ctx.max_queued_requests
    would_wait = client.num_open >= client.cfg.max_running_requests or client.sched_stats.get("waiting", 0) > 0
    if limit is not None and would_wait and client.num_waiting() >= limit:
        raise APIError(
            503, f"the server is busy: {client.num_waiting()} requests are waiting (--max-queued-requests "
            f"{limit}); retry later", "service_unavailable_error", code="queue_full", headers={"Retry-After": "1"},
        )  # fmt: skip


async def until_disconnect(request: Request, work: Awaitable[T], poll_s: float = 0.5) -> T | None:
    """Run `work`; cancel it (which aborts its request) and return None if the client disconnects first."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                return task.result()
            if await request.is_disconnected():
                return None
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, EngineError):
                await task


async def _prepare(request: Request, ctx: ServerContext, parse: Callable) -> Prepared:
    body = load_json(await request.body())
    req = parse(body, ctx.tokenizer, ctx.limits)
    admit(ctx)
    return req


async def _whole(request: Request, deltas: AsyncIterator[Delta]) -> tuple[str, Delta] | None:
    try:
        return await until_disconnect(request, collect(deltas))
    except EngineError as e:
        kind = "invalid_request_error" if e.status == 400 else "service_unavailable_error"
        raise APIError(e.status, str(e), kind) from None


def _stream(events: AsyncIterator[dict]) -> StreamingResponse:
    return StreamingResponse(sse(events), media_type="text/event-stream", headers=_SSE_HEADERS)


# -- /v1/completions ---------------------------------------------------------------------------------------------
async def completions(request: Request, ctx: ServerContext) -> Response:
    req = await _prepare(request, ctx, parse_completion)
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    base = {"id": rid, "object": "text_completion", "created": created, "model": ctx.model_name}
    deltas = text_deltas(ctx, rid, req)
    if req.stream:
        return _stream(_completion_events(base, deltas, req.include_usage))
    result = await _whole(request, deltas)
    if result is None:
        return Response(status_code=499)
    text, last = result
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": last.finish_reason}
    return JSONResponse({**base, "choices": [choice], "usage": usage(last)})


async def _completion_events(base: dict, deltas: AsyncIterator[Delta], include_usage: bool) -> AsyncIterator[dict]:
    extra = {"usage": None} if include_usage else {}
    last = None
    async with contextlib.aclosing(deltas) as it:
        async for d in it:
            last = d
            choice = {"index": 0, "text": d.text, "logprobs": None, "finish_reason": d.finish_reason}
            yield {**base, "choices": [choice], **extra}
    if include_usage and last is not None:
        yield {**base, "choices": [], "usage": usage(last)}


# -- /v1/chat/completions ----------------------------------------------------------------------------------------
async def chat_completions(request: Request, ctx: ServerContext) -> Response:
    req = await _prepare(request, ctx, parse_chat)
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    deltas = text_deltas(ctx, rid, req)
    if req.stream:
        base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": ctx.model_name}
        return _stream(_chat_events(base, deltas, req.include_usage))
    result = await _whole(request, deltas)
    if result is None:
        return Response(status_code=499)
    text, last = result
    message = {"role": "assistant", "content": text}
    choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": last.finish_reason}
    base = {"id": rid, "object": "chat.completion", "created": created, "model": ctx.model_name}
    return JSONResponse({**base, "choices": [choice], "usage": usage(last)})


async def _chat_events(base: dict, deltas: AsyncIterator[Delta], include_usage: bool) -> AsyncIterator[dict]:
    extra = {"usage": None} if include_usage else {}

    def chunk(delta: dict, finish: str | None = None) -> dict:
        return {**base, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}], **extra}

    yield chunk({"role": "assistant", "content": ""})
    last = None
    async with contextlib.aclosing(deltas) as it:
        async for d in it:
            last = d
            if d.text:
                yield chunk({"content": d.text})
            if d.finish_reason:
                yield chunk({}, d.finish_reason)
    if include_usage and last is not None:
        yield {**base, "choices": [], "usage": usage(last)}


# -- /generate (SGLang) ------------------------------------------------------------------------------------------
async def generate(request: Request, ctx: ServerContext) -> Response:
    req = await _prepare(request, ctx, parse_generate)
    rid, arrival = f"gen-{uuid.uuid4().hex}", time.monotonic()
    deltas = text_deltas(ctx, rid, req)
    if req.stream:
        return _stream(_generate_events(rid, arrival, deltas))
    result = await _whole(request, deltas)
    if result is None:
        return Response(status_code=499)
    text, last = result
    return JSONResponse({"text": text, "meta_info": _meta(rid, arrival, last)})


def _meta(rid: str, arrival: float, d: Delta) -> dict:
    finish = None
    if d.finish_reason == "length":
        finish = {"type": "length", "length": d.completion_tokens}
    elif d.finish_reason:
        finish = {"type": d.finish_reason, "matched": d.matched_stop}
    return {
        "id": rid, "finish_reason": finish, "prompt_tokens": d.prompt_tokens,
        "completion_tokens": d.completion_tokens, "e2e_latency": time.monotonic() - arrival,
    }  # fmt: skip


async def _generate_events(rid: str, arrival: float, deltas: AsyncIterator[Delta]) -> AsyncIterator[dict]:
    """SGLang streams the text so far in every chunk, not the increment."""
    text = ""
    async with contextlib.aclosing(deltas) as it:
        async for d in it:
            text += d.text
            yield {"text": text, "meta_info": _meta(rid, arrival, d)}
