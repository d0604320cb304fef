"""One request from validated input to text: engine tokens -> detokenizer -> stop strings -> deltas.

Contract: `text_deltas(ctx, rid, prepared)` yields `Delta`s (text safe to show, and on the last one the finish
reason and token counts) and records the request's metrics however it ends. A stop string ends the request
early: the generator is closed, which aborts it on the ring. `sse(events)` turns dict events into server-sent
events ending with `data: [DONE]`, with a keep-alive comment after every `SSE_KEEPALIVE_S` without an event;
an error mid-stream becomes an error chunk, never a hang.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import anyio

from ringsched.detokenizer import TextStream
from ringsched.server.engine_client import EngineClient, EngineError
from ringsched.server.grammar_pool import GrammarPool
from ringsched.server.http_limits import HttpLimits
from ringsched.server.metrics import ServerMetrics
from ringsched.server.protocol import Limits, Prepared
from ringsched.tokenizer import Tokenizer

logger = logging.getLogger("ringsched.server")

CLOSE_S = 10.0  # at most this long for a stream's cleanup after its client left
SSE_KEEPALIVE_S = 5.0  # a stream that waits (queued, a long prefill, a hung stage) still hears from us
DEFAULT_MAX_REQUEST_BYTES = 8 * 2**20


@dataclass
class ServerContext:
    """What every handler needs; built once by `create_app`."""

    client: EngineClient
    tokenizer: Tokenizer
    metrics: ServerMetrics
    limits: Limits  # context length, KV tokens, vocabulary, served model name
    api_key: str | None = None
    max_queued_requests: int | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    http: HttpLimits = HttpLimits()  # connection and read timeouts, the open-connection limit
    grammars: GrammarPool | None = None  # proves structured-output grammars; None: they are refused
    reasoning_parser: str | None = None  # --reasoning-parser: chat answers carry `reasoning_content` apart

    @property
    def model_name(self) -> str:
        return self.limits.model_name


@dataclass
class Delta:
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str | None = None  # "stop" or "length" on the last delta
    matched_stop: str | int | None = None  # the stop string or token that ended it, if any
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # (token id, its log-probability, [(id, log-probability)] of the most likely) for each token since the
    # previous delta, when the request asked for log-probabilities
    logprobs: list[tuple[int, float, list]] = field(default_factory=list)
    # with the first delta, when the request asked for them: per prompt token after the first, (its
    # log-probability, its rank, [(id, log-probability)] of the most likely)
    prompt_logprobs: list | None = None


async def text_deltas(ctx: ServerContext, rid: str, req: Prepared) -> AsyncIterator[Delta]:
    stream = TextStream(ctx.tokenizer, req.prompt_ids, req.params.stop)
    arrival, first, n, reason = time.monotonic(), None, 0, "abort"  # "abort" unless it ends otherwise
    cached = 0
    lps: list[tuple[int, float, list]] = []  # log-probabilities not yet handed out with a delta
    scores = None  # the prompt's log-probabilities, until handed out
    try:
        async with contextlib.aclosing(ctx.client.generate(rid, req.prompt_ids, req.params)) as outs:
            async for out in outs:
                first = first or time.monotonic()
                text, used = stream.add_until_stop(out.token_ids)  # the tokens up to a stop string's end
                n = (out.completion_tokens or n + len(out.token_ids)) - (len(out.token_ids) - used)
                cached = out.cached_tokens or cached
                if out.logprobs:
                    lps += [(t, lp, top) for t, (lp, top) in zip(out.token_ids[:used], out.logprobs, strict=False)]
                scores = out.prompt_logprobs if out.prompt_logprobs is not None else scores
                if stream.stopped:  # a stop string: leaving the loop closes `outs`, which aborts the request
                    reason = "stop"
                    yield Delta(text, len(req.prompt_ids), n, "stop", stream.stops.matched, cached, lps, scores)
                    return
                if out.finish_reason:
                    text += stream.finish()
                    reason = out.finish_reason
                    matched = out.token_ids[-1] if reason == "stop" and out.token_ids else None
                    yield Delta(text, len(req.prompt_ids), n, reason, matched, cached, lps, scores)
                    return
                if text:
                    yield Delta(
                        text, len(req.prompt_ids), n, cached_tokens=cached, logprobs=lps, prompt_logprobs=scores
                    )
                    lps, scores = [], None
    except EngineError:
        reason = "error"
        raise
    finally:
        ctx.metrics.request_finished(reason, len(req.prompt_ids), n, arrival, first, time.monotonic(), cached)


async def collect(deltas: AsyncIterator[Delta]) -> tuple[str, Delta]:
    """All the text of a non-streaming request, and its last delta (finish reason, token counts) holding every
    token's log-probabilities."""
    parts: list[str] = []
    lps: list = []
    last, scores = None, None
    async with contextlib.aclosing(deltas) as it:
        async for d in it:
            parts.append(d.text)
            lps += d.logprobs
            scores = d.prompt_logprobs if d.prompt_logprobs is not None else scores
            last = d
    assert last is not None and last.finish_reason, "the engine ended a request without a finish reason"
    last.logprobs, last.prompt_logprobs = lps, scores
    return "".join(parts), last


def usage(d: Delta) -> dict:
    return {
        "prompt_tokens": d.prompt_tokens,
        "completion_tokens": d.completion_tokens,
        "total_tokens": d.prompt_tokens + d.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": d.cached_tokens},
    }


def error_event(e: Exception) -> dict:
    if isinstance(e, EngineError):
        return {"error": {"message": str(e), "type": e.type, "param": None, "code": e.code}}
    message = f"internal server error: {type(e).__name__}: {e}"
    return {"error": {"message": message, "type": "internal_server_error", "param": None, "code": "internal_error"}}


def _data(ev: dict) -> bytes:
    return b"data: " + json.dumps(ev, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


async def sse(events: AsyncIterator[dict], keepalive_s: float | None = None) -> AsyncIterator[bytes]:
    """Server-sent events. Each next event is awaited in a task of its own so that a silent wait can be
    broken by keep-alive comments (which clients ignore) without cancelling the events' generator."""
    keepalive_s = SSE_KEEPALIVE_S if keepalive_s is None else keepalive_s
    pending: asyncio.Future | None = None
    try:
        while True:
            pending = pending or asyncio.ensure_future(anext(events))
            done, _ = await asyncio.wait({pending}, timeout=keepalive_s)
            if not done:
                yield b": keep-alive\n\n"
                continue
            task, pending = pending, None
            try:
                ev = task.result()
            except StopAsyncIteration:
                break
            yield _data(ev)
    except Exception as e:  # EngineError, or a bug in this request's path: this stream ends, the server goes on
        if not isinstance(e, EngineError):
            logger.exception("a streamed request failed")
        yield _data(error_event(e))
    finally:
        await _close(events, pending)
    yield b"data: [DONE]\n\n"


async def _close(events: AsyncIterator[dict], pending: asyncio.Future | None) -> None:
    """Close the events' generator, after the event awaited when the client left (`pending`) has finished its
    cleanup (release, abort): closing a generator still running in that task fails. Shielded, because the
    server cancels a departed client's request scope again at every await (anyio's cancel scopes), which would
    cut the cleanup short (bounded by `CLOSE_S`, so a stuck cleanup cannot hold the request open)."""
    with anyio.move_on_after(CLOSE_S, shield=True):
        if pending is not None:
            pending.cancel()
            await asyncio.wait({pending})
        await events.aclose()
