"""SGLang's native `/generate`: `text` or `input_ids` and SGLang's `sampling_params` in, its `text` and
`meta_info` out, whole or streamed (each chunk the text so far), served as the OpenAI endpoints are (`_serve`)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from ringsched.server.endpoints import _serve
from ringsched.server.protocol import Prepared, parse_generate
from ringsched.server.serving import Delta, ServerContext


async def generate(request: Request, ctx: ServerContext) -> Response:
    arrival = time.monotonic()

    def events(rid: str, deltas: list[AsyncIterator[Delta]], req: Prepared) -> AsyncIterator[dict]:
        return _generate_events(rid, arrival, deltas[0])

    def whole(rid: str, results: list[tuple[str, Delta]], every: dict, req: Prepared) -> dict:
        text, last = results[0]
        return {"text": text, "meta_info": _meta(rid, arrival, last)}

    return await _serve(request, ctx, parse_generate, "gen", events, whole)


def _meta(rid: str, arrival: float, d: Delta) -> dict:
    finish = None
    if d.finish_reason == "length":
        finish = {"type": "length", "length": d.completion_tokens}
    elif d.finish_reason:
        finish = {"type": d.finish_reason, "matched": d.matched_stop}
    return {
        "id": rid,
        "finish_reason": finish,
        "prompt_tokens": d.prompt_tokens,
        "completion_tokens": d.completion_tokens,
        "e2e_latency": time.monotonic() - arrival,
    }


async def _generate_events(rid: str, arrival: float, deltas: AsyncIterator[Delta]) -> AsyncIterator[dict]:
    """SGLang streams the text so far in every chunk, not the increment."""
    text = ""
    async with contextlib.aclosing(deltas) as it:
        async for d in it:
            text += d.text
            yield {"text": text, "meta_info": _meta(rid, arrival, d)}
