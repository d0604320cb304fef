"""A request's intake, from its bytes to a `Prepared` request: the body read within its size and time limits,
parsed and tokenized off the event loop, its structured-output constraint proven in a grammar helper process.

Contract: `prepare(request, ctx, parse)` returns the `Prepared` request or raises `APIError` (413 for a body past
`--max-request-bytes`, 408 for one slower than `--http-body-timeout`, 400 for a bad request or a grammar its
helper refused, 503 when every helper stays busy) or `ClientGone` when the client left before its body was read.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace

from fastapi import Request
from starlette.requests import ClientDisconnect

from ringsched.sampling.structured import GrammarError
from ringsched.server.errors import APIError
from ringsched.server.grammar_pool import GrammarBusy
from ringsched.server.grammar_request import Asked
from ringsched.server.json_body import load_json
from ringsched.server.protocol import Prepared
from ringsched.server.serving import ServerContext

# A refused body is read on (and dropped) up to this many times the limit, so that a client still sending it
# gets to read the 413 instead of a reset connection; past that the connection is closed.
_DRAIN_FACTOR = 4


class ClientGone(Exception):
    """The client closed the connection before its request was read: nobody is left to answer."""


async def read_body(request: Request, limit: int, timeout_s: float | None = None) -> bytes:
    """The body, or a 413 once it passes `limit` bytes (at once when its Content-Length says so); a 408 when it
    has not all come within `timeout_s` (`--http-body-timeout`); `ClientGone` when the client leaves."""
    declared = request.headers.get("content-length", "")
    size, chunks, too_big = 0, [], declared.isdigit() and int(declared) > limit
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                too_big = too_big or size > limit
                if too_big and size > _DRAIN_FACTOR * limit:
                    break
                if not too_big:
                    chunks.append(chunk)
    except TimeoutError:
        raise APIError(
            408,
            f"The request body did not arrive within {timeout_s:g} s (--http-body-timeout)",
            code="request_timeout",
            headers={"Connection": "close"},
        ) from None
    except ClientDisconnect:
        raise ClientGone from None
    if too_big:
        raise APIError(
            413,
            f"The request body is larger than this server accepts ({limit} bytes, --max-request-bytes)",
            code="request_too_large",
        )
    return b"".join(chunks)


async def prepare(request: Request, ctx: ServerContext, parse: Callable) -> Prepared:
    raw = await read_body(request, ctx.max_request_bytes, ctx.http.body_timeout)
    # Parsing, chat templates and tokenization run on a worker thread (long texts are tokenized without the GIL):
    # a big request must not stall the streams and health checks this loop serves.
    req = await asyncio.to_thread(lambda: parse(load_json(raw), ctx.tokenizer, ctx.limits))
    if req.grammar is None:
        return req
    return replace(req, params=replace(req.params, grammar=await _proven(ctx, req.grammar)))


async def _proven(ctx: ServerContext, asked: Asked) -> str:
    """The grammar of a request's constraint, proven in a helper process (a 400 naming its field if not)."""
    if ctx.grammars is None:
        raise APIError(400, "this server was started without structured outputs", param=asked.field)
    try:
        return await ctx.grammars.prove(asked.form)
    except GrammarError as e:
        raise APIError(400, f"{asked.field}: {e}", param=asked.field) from None
    except GrammarBusy as e:
        raise APIError(
            503, str(e), "service_unavailable_error", code="grammar_busy", headers={"Retry-After": "1"}
        ) from None
