"""The generation endpoints: `/v1/completions`, `/v1/chat/completions` (OpenAI); SGLang's `/generate` serves
through the same `_serve` (`sglang_generate.py`).

Each handler takes the request in (intake.py: the body read within its limits, validated and tokenized off the event
loop, its grammar proven), admits it (the open count is taken here, before any await: 503 when shutting down, unhealthy
or when running plus queued requests are full), then streams server-sent events or waits for the whole text. The request
is released (its count, and on the ring its KV) on every path: `_Stream` releases it once its response is over, even one
that never started; a non-streaming request whose client goes away is aborted too (`until_disconnect` polls the
connection while the request runs).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from ringsched.server.chat_output import ChatAnswer
from ringsched.server.choices import best, collect_all, combined_usage, merged
from ringsched.server.engine_client import EngineError
from ringsched.server.intake import ClientGone, prepare, read_body
from ringsched.server.json_body import load_json
from ringsched.server.logprobs_shapes import (
    chat_logprobs,
    completion_logprobs,
    echoed_logprobs,
    joined,
    prompt_logprobs,
)
from ringsched.server.protocol import APIError, Prepared, parse_chat, parse_completion
from ringsched.server.serving import Delta, ServerContext, sse, text_deltas
from ringsched.tokenizer import Tokenizer

logger = logging.getLogger("ringsched.server")
T = TypeVar("T")
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def admit(ctx: ServerContext, rid: str) -> None:
    try:
        ctx.client.admit(rid, ctx.max_queued_requests)
    except EngineError as e:
        headers = {"Retry-After": "1"} if e.code == "queue_full" else None
        raise APIError(e.status, str(e), e.type, code=e.code, headers=headers) from None


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


class _Stream(StreamingResponse):
    """An SSE response that releases its request when it is over, however it ends (even never started)."""

    def __init__(self, events: AsyncIterator[dict], release: Callable[[], None]) -> None:
        super().__init__(sse(events), media_type="text/event-stream", headers=_SSE_HEADERS)
        self._release = release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release()


Events = Callable[[str, list[AsyncIterator[Delta]], Prepared], AsyncIterator[dict]]  # (rid, deltas per sequence, req)
# (rid, (text, last delta) per choice returned, the usage of every sequence run) -> the response body
Whole = Callable[[str, list[tuple[str, Delta]], dict, Prepared], dict]


async def _serve(
    request: Request, ctx: ServerContext, parse: Callable, prefix: str, events: Events, whole: Whole
) -> Response:
    """Prepare, admit (every sequence of an `n` or `best_of` request), then stream `events(rid, deltas, req)` or
    answer `whole(rid, results, usage, req)`. A bug on this path is this request's 500 (logged), not an unhandled
    error that would also drop the connection."""
    try:
        return await _serve_one(request, ctx, parse, prefix, events, whole)
    except APIError:
        raise
    except ClientGone:  # a client may leave whenever it likes: nothing to log above debug
        logger.debug("%s %s: the client left before its body was read", request.method, request.url.path)
        return Response(status_code=499)
    except Exception as e:
        logger.exception("internal error in %s %s", request.method, request.url.path)
        raise APIError(
            500, f"internal server error: {type(e).__name__}: {e}", "internal_server_error", code="internal_error"
        ) from None


async def _serve_one(
    request: Request, ctx: ServerContext, parse: Callable, prefix: str, events: Events, whole: Whole
) -> Response:
    req = await prepare(request, ctx, parse)
    rid = f"{prefix}-{uuid.uuid4().hex}"
    sequences = req.sequences(rid)
    admitted: list[str] = []

    def release() -> None:
        for seq_rid in admitted:
            ctx.client.release(seq_rid)

    streaming = False
    try:
        for seq_rid, _ in sequences:  # every sequence counts as an open request
            admit(ctx, seq_rid)
            admitted.append(seq_rid)
        deltas = [text_deltas(ctx, seq_rid, replace(req, params=params)) for seq_rid, params in sequences]
        if req.stream:
            response = _Stream(events(rid, deltas, req), release)
            streaming = True
            return response
        try:
            results = await until_disconnect(request, collect_all(deltas))
        except EngineError as e:
            raise APIError(e.status, str(e), e.type, code=e.code) from None
        if results is None:
            return Response(status_code=499)
        every = combined_usage([last for _, last in results])  # best_of: the sequences not returned count too
        return JSONResponse(whole(rid, best(results, req), every, req))
    finally:
        if not streaming:
            release()


async def tokens(request: Request, ctx: ServerContext, answer: Callable) -> Response:
    """`/tokenize` and `/detokenize`: the body read and `answer(body, tokenizer, limits)` run off the event loop."""
    try:
        raw = await read_body(request, ctx.max_request_bytes, ctx.http.body_timeout)
    except ClientGone:
        return Response(status_code=499)
    return JSONResponse(await asyncio.to_thread(lambda: answer(load_json(raw), ctx.tokenizer, ctx.limits)))


# -- /v1/completions ---------------------------------------------------------------------------------------------
async def completions(request: Request, ctx: ServerContext) -> Response:
    created = int(time.time())

    def base(rid: str) -> dict:
        return {"id": rid, "object": "text_completion", "created": created, "model": ctx.model_name}

    def events(rid: str, deltas: list[AsyncIterator[Delta]], req: Prepared) -> AsyncIterator[dict]:
        return _completion_events(base(rid), deltas, req, ctx.tokenizer)

    def whole(rid: str, results: list[tuple[str, Delta]], every: dict, req: Prepared) -> dict:
        choices = []
        for i, (text, last) in enumerate(results):
            logprobs = _echoed(ctx.tokenizer, req, last, 0)[1]
            choice = {"index": i, "text": (req.echo or "") + text, "logprobs": logprobs}
            choice["finish_reason"] = last.finish_reason
            if req.prompt_logprobs:
                choice["prompt_logprobs"] = prompt_logprobs(ctx.tokenizer, req.prompt_ids, last.prompt_logprobs)
            choices.append(choice)
        return {**base(rid), "choices": choices, "usage": every}

    return await _serve(request, ctx, parse_completion, "cmpl", events, whole)


def _echoed(tok: Tokenizer, req: Prepared, d: Delta, offset: int) -> tuple[int, dict | None]:
    """A completion delta's log-probabilities from character `offset` on, led by the echoed prompt's where `echo`
    and `logprobs` were asked for and `d` is the first; and the offset after them."""
    head = None
    if req.echo is not None and req.logprobs_asked and d.prompt_logprobs is not None:
        head = echoed_logprobs(tok, req.prompt_ids, d.prompt_logprobs, req.params.logprobs or 0)
        offset = head["text_offset"][-1] + len(head["tokens"][-1])
    rest = completion_logprobs(tok, d.logprobs, offset)
    offset += sum(len(t) for t in rest["tokens"]) if rest else 0
    return offset, joined(head, rest) if head else rest


async def _completion_events(
    base: dict, deltas: list[AsyncIterator[Delta]], req: Prepared, tok: Tokenizer
) -> AsyncIterator[dict]:
    extra = {"usage": None} if req.include_usage else {}
    # `echo`: each choice starts with the prompt's text (with `logprobs`, in its first delta, which has the prompt's)
    lead = req.echo is not None and not req.logprobs_asked
    for i in range(len(deltas) if lead else 0):
        yield {**base, "choices": [{"index": i, "text": req.echo, "logprobs": None, "finish_reason": None}], **extra}
    last: dict[int, Delta] = {}
    offsets = [0] * len(deltas)
    async with contextlib.aclosing(merged(deltas)) as it:
        async for i, d in it:
            text = d.text if lead or req.echo is None or i in last else req.echo + d.text
            last[i] = d
            offsets[i], logprobs = _echoed(tok, req, d, offsets[i])
            choice = {"index": i, "text": text, "logprobs": logprobs, "finish_reason": d.finish_reason}
            yield {**base, "choices": [choice], **extra}
    if req.include_usage and last:
        yield {**base, "choices": [], "usage": combined_usage(list(last.values()))}


# -- /v1/chat/completions ----------------------------------------------------------------------------------------
async def chat_completions(request: Request, ctx: ServerContext) -> Response:
    created = int(time.time())

    def base(rid: str, kind: str) -> dict:
        return {"id": rid, "object": kind, "created": created, "model": ctx.model_name}

    def answer(req: Prepared) -> ChatAnswer:
        return ChatAnswer(ctx.reasoning_parser, req.tools, ctx.limits.tool_parser)

    def events(rid: str, deltas: list[AsyncIterator[Delta]], req: Prepared) -> AsyncIterator[dict]:
        answers = [answer(req) for _ in deltas]
        return _chat_events(base(rid, "chat.completion.chunk"), deltas, req.include_usage, ctx, answers)

    def whole(rid: str, results: list[tuple[str, Delta]], every: dict, req: Prepared) -> dict:
        choices = []
        for i, (text, last) in enumerate(results):
            message, finish = answer(req).message(text, last.finish_reason)
            logprobs = chat_logprobs(ctx.tokenizer, last.logprobs)
            choices.append({"index": i, "message": message, "logprobs": logprobs, "finish_reason": finish})
        out = {**base(rid, "chat.completion"), "choices": choices, "usage": every}
        if req.prompt_logprobs:  # vLLM's: the one prompt's, beside the choices
            out["prompt_logprobs"] = prompt_logprobs(ctx.tokenizer, req.prompt_ids, results[0][1].prompt_logprobs)
        return out

    return await _serve(request, ctx, parse_chat, "chatcmpl", events, whole)


async def _chat_events(
    base: dict, deltas: list[AsyncIterator[Delta]], include_usage: bool, ctx: ServerContext, answers: list[ChatAnswer]
) -> AsyncIterator[dict]:
    extra = {"usage": None} if include_usage else {}

    def chunk(i: int, delta: dict, finish: str | None = None, logprobs: dict | None = None) -> dict:
        choice = {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return {**base, "choices": [choice], **extra}

    for i in range(len(deltas)):
        yield chunk(i, {"role": "assistant", "content": ""})
    last: dict[int, Delta] = {}
    async with contextlib.aclosing(merged(deltas)) as it:
        async for i, d in it:
            last[i] = d
            logprobs = chat_logprobs(ctx.tokenizer, d.logprobs)
            out = answers[i].feed(d.text)
            for k, delta in enumerate(out or ([{"content": ""}] if logprobs else [])):
                yield chunk(i, delta, logprobs=logprobs if k == 0 else None)
            if d.finish_reason:
                held, finish = answers[i].finish(d.finish_reason)
                for delta in held:
                    yield chunk(i, delta)
                yield chunk(i, {}, finish)
    if include_usage and last:
        yield {**base, "choices": [], "usage": combined_usage(list(last.values()))}
