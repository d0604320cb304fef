"""A client run inside a test host's namespace (`ip netns exec NS python tests/ns_client.py ...`).

    wait URL... --timeout S       until every URL answers 200 (exit 1 naming the ones that did not)
    greedy BASE --prompt P --chat C --max-tokens N
                                  one greedy completion and one greedy chat with the `openai` package;
                                  prints {"completion": text, "chat": text}
    streams BASE --n K --max-tokens N [--sampled]
                                  K concurrent streaming completions (greedy; with --sampled, every second one
                                  samples with seed 1000 + its index); prints "STARTED" once every stream has its
                                  first token, then one JSON line per stream: how it ended and its text

Results are the last line of stdout, as JSON, so a test reads them from the process's log.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

import httpx
from sse import read_sse


def wait(urls: list[str], timeout: float) -> int:
    deadline = time.monotonic() + timeout
    pending = list(urls)
    with httpx.Client(timeout=2, trust_env=False) as hc:
        while pending and time.monotonic() < deadline:
            for u in list(pending):
                try:
                    if hc.get(u).status_code == 200:
                        pending.remove(u)
                except httpx.HTTPError:
                    pass
            time.sleep(0.3)
    if pending:
        print(f"not ready after {timeout:.0f}s: {pending}")
        return 1
    print("READY")
    return 0


def greedy(base: str, prompt: str, chat: str, max_tokens: int) -> int:
    import openai

    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    c = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0)
    messages = [{"role": "user", "content": chat}]
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0)
    print(json.dumps({"completion": c.choices[0].text, "chat": r.choices[0].message.content}))
    return 0


def _stream_body(i: int, max_tokens: int, sampled: bool) -> dict:
    body = {"prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    if not sampled:
        return body
    return {**body, "prompt": f"Story {i}: once upon a time",
            **({"temperature": 0.8, "seed": 1000 + i} if i % 2 else {"temperature": 0})}


async def streams(base: str, n: int, max_tokens: int, timeout: float, sampled: bool = False) -> int:
    async with httpx.AsyncClient(timeout=timeout, trust_env=False) as hc:
        model = (await hc.get(f"{base}/v1/models")).json()["data"][0]["id"]
        firsts = [asyncio.Event() for _ in range(n)]
        url = f"{base}/v1/completions"
        tasks = [asyncio.create_task(read_sse(hc, url, {**_stream_body(i, max_tokens, sampled), "model": model}, ev))
                 for i, ev in enumerate(firsts)]  # fmt: skip
        await asyncio.gather(*(ev.wait() for ev in firsts))
        print("STARTED", flush=True)
        results = [{**r, "chunks": len(r["chunks"]), "text": "".join(c["choices"][0].get("text") or "" for c in
                                                                     r["chunks"] if c.get("choices"))}
                   for r in await asyncio.gather(*tasks)]  # fmt: skip
    print(json.dumps(results))
    return 0


def main() -> int:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("wait")
    w.add_argument("urls", nargs="+")
    w.add_argument("--timeout", type=float, default=120)
    g = sub.add_parser("greedy")
    g.add_argument("base")
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", required=True)
    g.add_argument("--max-tokens", type=int, default=16)
    s = sub.add_parser("streams")
    s.add_argument("base")
    s.add_argument("--n", type=int, default=3)
    s.add_argument("--max-tokens", type=int, default=500)
    s.add_argument("--timeout", type=float, default=60, help="longest silence on a stream before giving up")
    s.add_argument("--sampled", action="store_true")
    a = p.parse_args()
    if a.cmd == "wait":
        return wait(a.urls, a.timeout)
    if a.cmd == "greedy":
        return greedy(a.base, a.prompt, a.chat, a.max_tokens)
    return asyncio.run(streams(a.base, a.n, a.max_tokens, a.timeout, a.sampled))


if __name__ == "__main__":
    sys.exit(main())
