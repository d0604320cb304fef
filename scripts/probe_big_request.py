"""While 4 streams run on a server, send one big request and time `/health` and the streams' token gaps.

    python scripts/probe_big_request.py http://127.0.0.1:30000 10000000          # a 10 MB completions body
    python scripts/probe_big_request.py http://127.0.0.1:30000 600000 chat       # a 600 kB chat message

Prints the big request's status, message and time, the slowest `/health` answer and the longest gap between
two events of a running stream. A measurement, not a test: the server must already run (no --api-key).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import httpx


async def _stream(hc: httpx.AsyncClient, url: str, gaps: list[float]) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 120, "ignore_eos": True, "stream": True}
    last = None
    async with hc.stream("POST", f"{url}/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                now = time.monotonic()
                if last is not None:
                    gaps.append(now - last)
                last = now


async def _health(hc: httpx.AsyncClient, url: str, latencies: list[float], stop: asyncio.Event) -> None:
    while not stop.is_set():
        start = time.monotonic()
        await hc.get(f"{url}/health")
        latencies.append(time.monotonic() - start)
        await asyncio.sleep(0.05)


async def main(url: str, size: int, kind: str) -> None:
    gaps: list[float] = []
    latencies: list[float] = []
    stop = asyncio.Event()
    text = "word " * (size // 5)
    if kind == "chat":
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}
    else:
        path, body = "/v1/completions", {"prompt": text}
    raw = json.dumps(body).encode()
    async with httpx.AsyncClient(timeout=120) as hc:
        streams = [asyncio.create_task(_stream(hc, url, gaps)) for _ in range(4)]
        health = asyncio.create_task(_health(hc, url, latencies, stop))
        await asyncio.sleep(2)
        start = time.monotonic()
        r = await hc.post(f"{url}{path}", content=raw, headers={"content-type": "application/json"})
        took = time.monotonic() - start
        message = r.json().get("error", {}).get("message", "")[:120]
        print(f"{len(raw)} bytes -> {r.status_code} in {took:.2f}s: {message}")
        await asyncio.gather(*streams)
        stop.set()
        await health
    print(f"/health: {len(latencies)} answers, slowest {max(latencies):.3f}s; stream gaps: longest {max(gaps):.3f}s")


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else "completion"))
