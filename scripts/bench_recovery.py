"""How long a stream pauses when a rank dies (`--max-restarts`), against what the pause is made of.

Serves the model (`python -m ringsched.launch`, real HTTP), runs `--streams` streaming completions to the end
undisturbed, then again with SIGKILL of one stage once every stream has `--kill-after` tokens, and reports per
scenario: whether every text equals its undisturbed one and no stream saw an error; the recovery (the kill to the
first token any stream receives after it, and to the last stream's first); the supervisor's own account (the
failure seen to every rank ready, of it the replacement's start: a cold start of one stage); and the rest, the
open requests' tokens prefilled again (from `/health` answering 200 to the first resumed token).

    python scripts/bench_recovery.py --pp 2 --victims 0,1 --streams 16
    python scripts/bench_recovery.py --pp 3 --victims 0,1,2
    python scripts/bench_recovery.py --pp 2 --victims 1t1 --flags="--tp-size 2"        # a TP rank
    python scripts/bench_recovery.py --pp 1 --victims 0c1 --flags="--cp-size 2"        # a CP rank
    python scripts/bench_recovery.py --pp 3 --victims 1 --fault stop                   # a hung stage (SIGSTOP)
    python scripts/bench_recovery.py --pp 3 --victims 1 --fault twice                  # killed again once back
    python scripts/bench_recovery.py --pp 3 --victims 1 --fault during                 # stage 2 killed meanwhile

A victim is a process name's tail: `1` is `ringsched-pp1`, `1t1` `ringsched-pp1t1`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

PROMPT = "Write a long story about a lighthouse keeper and the ships she watched over the years."


def serve(pp: int, port: int, log: Path, flags: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "ringsched.launch", "--pp-size", str(pp), "--port", str(port),
           "--threads-per-stage", "1", "--max-model-len", "1024", "--kv-cache-memory", "256M",
           "--heartbeat-timeout", "3", *flags]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited: see {log}")
        time.sleep(0.5)
    raise TimeoutError("the server was not ready in 300 s")


async def stream(hc: httpx.AsyncClient, url: str, i: int, tokens: int, marks: list) -> tuple[str, list[float], str]:
    body = {"prompt": f"{PROMPT} ({i})", "max_tokens": tokens, "ignore_eos": True, "stream": True,
            "temperature": 0.8 if i % 2 else 0.0, "seed": i}  # fmt: skip
    text, times, error = "", [], ""
    async with hc.stream("POST", url, json=body) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                error = str(chunk["error"])
                continue
            text += chunk["choices"][0]["text"]
            times.append(time.monotonic())
            marks[i] = len(times)
    return text, times, error


async def healthy(hc: httpx.AsyncClient, port: int) -> bool:
    try:
        return (await hc.get(f"http://127.0.0.1:{port}/health", timeout=1)).status_code == 200
    except httpx.HTTPError:
        return False


async def run(port: int, n: int, tokens: int, kill: tuple[str, int, str, str] | None) -> dict:
    """`kill`: (victim, after, fault, second): once every stream has `after` chunks, SIGKILL (or SIGSTOP, fault
    `stop`) the victim; fault `twice`: the victim's replacement too, once back and 16 tokens on; `during`: the
    `second` victim while the first is being replaced."""
    url, marks = f"http://127.0.0.1:{port}/v1/completions", [0] * n
    async with httpx.AsyncClient(timeout=600) as hc:
        tasks = [asyncio.create_task(stream(hc, url, i, tokens, marks)) for i in range(n)]
        killed = health = None
        while kill and killed is None:
            await asyncio.sleep(0.01)
            if min(marks) >= kill[1]:
                os.kill(stage_pid(kill[0]), signal.SIGSTOP if kill[2] == "stop" else signal.SIGKILL)
                killed = time.monotonic()
        if kill and kill[2] == "during":
            while await healthy(hc, port):
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.3)
            os.kill(stage_pid(kill[3]), signal.SIGKILL)
        if kill and kill[2] == "twice":
            while not await healthy(hc, port) or min(marks) < kill[1] + 16:
                await asyncio.sleep(0.05)
            os.kill(stage_pid(kill[0]), signal.SIGKILL)
            killed = time.monotonic()
        noticed = time.monotonic() + 10  # a hung rank is noticed after --heartbeat-timeout: /health 503 first
        while killed and await healthy(hc, port) and time.monotonic() < noticed:
            await asyncio.sleep(0.05)
        while killed and health is None:
            await asyncio.sleep(0.05)
            if await healthy(hc, port):
                health = time.monotonic()
        results = await asyncio.gather(*tasks)
    out = {"texts": [r[0] for r in results], "errors": [r[2] for r in results if r[2]]}
    if killed:
        # Tokens already on their way when the stage died still arrive for a moment: a resumed token is one after
        # `/health` answered 200 again (every rank ready, the requests replayed).
        firsts = [next(t for t in r[1] if t > health) for r in results if any(t > health for t in r[1])]
        out |= {"first": min(firsts) - killed, "last": max(firsts) - killed, "health": health - killed,
                "reprefill": min(firsts) - health}  # fmt: skip
    return out


def stage_pid(victim: str) -> int:
    return int(subprocess.run(["pgrep", "-n", "-x", f"ringsched-pp{victim}"], capture_output=True, text=True,
                              check=True).stdout.split()[0])  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--victims", default="0,1")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--kill-after", type=int, default=32)
    ap.add_argument("--port", type=int, default=31500)
    ap.add_argument("--flags", default="", help="more launcher flags, e.g. --flags='--tp-size 2'")
    ap.add_argument("--fault", choices=["kill", "stop", "twice", "during"], default="kill")
    ap.add_argument("--second", default="2", help="with --fault during: the rank killed while recovering")
    args = ap.parse_args()
    log = Path(f"/tmp/bench_recovery_pp{args.pp}.log")
    proc = serve(args.pp, args.port, log, args.flags.split())
    try:
        base = asyncio.run(run(args.port, args.streams, args.tokens, None))
        print(f"PP={args.pp} {args.flags}, {args.streams} streams x {args.tokens} tokens, {args.fault} after "
              f"{args.kill_after}")  # fmt: skip
        for victim in args.victims.split(","):
            got = asyncio.run(run(args.port, args.streams, args.tokens,
                                  (victim, args.kill_after, args.fault, args.second)))  # fmt: skip
            same = sum(a == b for a, b in zip(got["texts"], base["texts"], strict=True))
            for i, (a, b) in enumerate(zip(got["texts"], base["texts"], strict=True)):
                if a != b:
                    at = next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
                    print(f"  stream {i} ({'seeded' if i % 2 else 'greedy'}) differs at character {at}: "
                          f"{b[max(at - 30, 0):at + 30]!r} became {a[max(at - 30, 0):at + 30]!r}")
            whole = re.findall(r"whole again \(generation \d+\) after ([\d.]+)s, ([\d.]+)s of it", log.read_text())
            pause, start = (float(x) for x in whole[-1]) if whole else (float("nan"),) * 2
            print(f"  {args.fault} {victim}: {same}/{args.streams} texts as undisturbed, {len(got['errors'])} errors; "
                  f"first resumed token {got['first']:.2f} s after the kill (last stream {got['last']:.2f} s); "
                  f"supervisor: whole again after {pause:.2f} s, replacement start {start:.2f} s; /health 200 "
                  f"after {got['health']:.2f} s, re-prefill to the first token {got['reprefill']:.2f} s")  # fmt: skip
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(60)


if __name__ == "__main__":
    main()
