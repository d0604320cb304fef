"""The hostile requests of a server's threat list, sent while 4 streams run: each one's status and time, the
slowest `/health` answer and the streams' longest gap between two events, then idle and slow connections.

    python scripts/probe_hostile.py http://127.0.0.1:30000 KEY

The server must already run with `--api-key KEY`. A measurement, not a test (tests/test_connections.py and the
fuzz table assert the statuses).
"""

from __future__ import annotations

import asyncio
import socket
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from fuzz_cases import ref_chain, right_recursive_rules  # noqa: E402

BASE = {"prompt": "Once upon a time", "max_tokens": 8}
HOSTILE = {
    "guided_json $ref x3000": {**BASE, "guided_json": ref_chain(3000)},
    "guided_grammar 20,000 rules": {**BASE, "guided_grammar": right_recursive_rules(20_000)},
    "guided_regex (a{1000}){1000}": {**BASE, "guided_regex": "(a{1000}){1000}"},
    "guided_choice x20,000": {**BASE, "guided_choice": [f"c{i}" for i in range(20_000)]},
    "n=16 best_of=16 max_tokens=8180": {"prompt": "hi", "n": 16, "best_of": 16, "max_tokens": 8180},
    "model name of 1 MB": {**BASE, "model": "m" * 2**20},
    "guided_json a valid schema": {**BASE, "guided_json": {"type": "object", "properties": {"a": {"type": "integer"}}}},
    # the heaviest of each form the bounds let through: proven in a helper while the streams run
    "guided_regex (a{100}){100}": {**BASE, "guided_regex": "(a{100}){100}"},
    "guided_grammar 998 rules": {**BASE, "guided_grammar": right_recursive_rules(998)},
    "guided_choice x1000": {**BASE, "guided_choice": [f"choice number {i}" for i in range(1000)]},
    "guided_json $ref x63": {**BASE, "guided_json": ref_chain(63)},
}


async def _stream(hc: httpx.AsyncClient, gaps: list[float]) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True, "stream": True}
    last = None
    async with hc.stream("POST", "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                now = time.monotonic()
                if last is not None:
                    gaps.append(now - last)
                last = now


async def _health(hc: httpx.AsyncClient, latencies: list[float], stop: asyncio.Event) -> None:
    while not stop.is_set():
        start = time.monotonic()
        await hc.get("/health")
        latencies.append(time.monotonic() - start)
        await asyncio.sleep(0.05)


async def requests(url: str, key: str) -> None:
    gaps: list[float] = []
    latencies: list[float] = []
    stop = asyncio.Event()
    async with httpx.AsyncClient(base_url=url, timeout=120, headers={"Authorization": f"Bearer {key}"}) as hc:
        streams = [asyncio.create_task(_stream(hc, gaps)) for _ in range(4)]
        health = asyncio.create_task(_health(hc, latencies, stop))
        await asyncio.sleep(2)
        for name, body in HOSTILE.items():
            start = time.monotonic()
            r = await hc.post("/v1/completions", json=body)
            err = r.json().get("error", {}) if r.status_code != 200 else {}
            print(f"{name:34s} -> {r.status_code} {err.get('param')!s:14s} {time.monotonic() - start:5.2f}s "
                  f"{err.get('message', '')[:90]}")  # fmt: skip
        for path, headers in (("/openapi.json", {}), ("/openapi.json", {"Authorization": f"bearer {key}"})):
            r = await httpx.AsyncClient(base_url=url).get(path, headers=headers)
            print(f"GET {path} with {headers or 'no key'} -> {r.status_code}")
        await asyncio.gather(*streams)
        stop.set()
        await health
    print(f"/health slowest {max(latencies):.3f}s of {len(latencies)}; streams' longest gap {max(gaps):.3f}s "
          f"(median {sorted(gaps)[len(gaps) // 2]:.3f}s)")  # fmt: skip


def connections(url: str, key: str, idle: int = 500, slow: int = 50) -> None:
    host, port = url.split("//")[1].split(":")
    socks = [socket.create_connection((host, int(port))) for _ in range(idle + slow)]
    start = time.monotonic()
    for s in socks:
        s.setblocking(False)
    served, closed_at = 0, {}
    request = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n"
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=30) as hc:
        while len(closed_at) < len(socks) and time.monotonic() - start < 60:
            i = int(time.monotonic() - start)
            for k, s in enumerate(socks[idle:]):
                if idle + k not in closed_at and i < len(request):
                    try:
                        s.send(request[i : i + 1])
                    except OSError:
                        pass
            for k, s in enumerate(socks):
                if k in closed_at:
                    continue
                try:
                    while s.recv(65536):
                        pass
                    closed_at[k] = time.monotonic() - start
                except BlockingIOError:
                    pass
                except OSError:
                    closed_at[k] = time.monotonic() - start
            served += hc.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code == 200
            time.sleep(0.5)
    idle_t = [closed_at[k] for k in range(idle) if k in closed_at]
    slow_t = [closed_at[k] for k in range(idle, idle + slow) if k in closed_at]
    print(f"{len(idle_t)}/{idle} idle closed by {max(idle_t, default=0):.1f}s, {len(slow_t)}/{slow} slow closed by "
          f"{max(slow_t, default=0):.1f}s; {served} normal requests served meanwhile")  # fmt: skip
    for s in socks:
        s.close()


if __name__ == "__main__":
    asyncio.run(requests(sys.argv[1], sys.argv[2]))
    connections(sys.argv[1], sys.argv[2])
