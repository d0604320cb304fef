"""Reading a server's SSE stream in tests: what came, how it ended."""

from __future__ import annotations

import asyncio
import json

import httpx


async def read_sse(hc: httpx.AsyncClient, url: str, body: dict, first: asyncio.Event | None = None) -> dict:
    """How one SSE stream went: its chunks, the error chunk if any, whether `[DONE]` came, or the HTTP or
    transport error that ended it. `first` is set at the first chunk with text, and when the stream ends."""
    out: dict = {"chunks": [], "error": None, "done": False, "transport_error": None}
    try:
        async with hc.stream("POST", url, json={**body, "stream": True}) as r:
            if r.status_code != 200:
                out["transport_error"] = f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"
                return out
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue  # keep-alive comments and blank separators
                if line == "data: [DONE]":
                    out["done"] = True
                elif "error" in (ev := json.loads(line[6:])):
                    out["error"] = ev["error"]
                else:
                    out["chunks"].append(ev)
                    if first is not None and ev.get("choices") and ev["choices"][0].get("text"):
                        first.set()
    except httpx.HTTPError as e:
        out["transport_error"] = f"{type(e).__name__}: {e}"
    finally:
        if first is not None:
            first.set()  # ended (one way or another): a stream that never sent text must not hold up its waiter
    return out
