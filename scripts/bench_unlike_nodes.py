"""Two nodes not alike, in network namespaces: node 0 on CPU 0, node 1 on CPU 1 sharing it with a busy process
(about 2x slower for real), PP=2 over them; the default split against the measured one (`--pp-layer-partition
auto`: each node times itself), interleaved rounds, saturated throughput and greedy texts compared. Needs root.

    sudo .venv/bin/python scripts/bench_unlike_nodes.py --rounds 3

Each round starts both nodes per split, waits for them, sends `--concurrency` greedy completions of
`--output-len` tokens (ignore_eos) from inside node 0's namespace, and reads the split from node 0's log.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS))

DIST_PORT, HTTP_PORT = 29500, 30000
SPLITS = {"default": [], "measured": ["--pp-layer-partition", "auto"]}


def client(base: str, n: int, output_len: int) -> None:
    """Inside node 0's namespace: `n` concurrent greedy completions; prints {"tok_s", "texts"}."""
    import httpx

    async def one(hc: httpx.AsyncClient, i: int) -> dict:
        body = {"model": "smollm2-135m-instruct", "prompt": f"Story number {i}: once upon a time",
                "max_tokens": output_len, "temperature": 0, "ignore_eos": True}  # fmt: skip
        r = await hc.post(f"{base}/v1/completions", json=body)
        r.raise_for_status()
        return r.json()

    async def run() -> None:
        async with httpx.AsyncClient(timeout=600, trust_env=False) as hc:
            await one(hc, 0)  # warm
            t0 = time.monotonic()
            outs = await asyncio.gather(*(one(hc, i) for i in range(n)))
            wall = time.monotonic() - t0
        tokens = sum(o["usage"]["completion_tokens"] for o in outs)
        print(json.dumps({"tok_s": tokens / wall, "texts": [o["choices"][0]["text"] for o in outs]}))

    asyncio.run(run())


def serve_round(net, name: str, args) -> dict:
    from test_multinode import CLIENT

    common = ["--model", "smollm2-135m-instruct", "--pp-size", "2", "--nnodes", "2", "--threads-per-stage", "1",
              "--dist-init-addr", f"{net.hosts[0].ip}:{DIST_PORT}", "--kv-cache-memory", "256M", "--host", "0.0.0.0",
              "--max-model-len", "1024", "--log-level", "info", *SPLITS[name]]  # fmt: skip
    nodes = [net.spawn(r, ["taskset", "-c", str(r), sys.executable, "-m", "ringsched.launch", "--node-rank", str(r),
                           *common], f"{name}-node{r}-{time.monotonic_ns()}") for r in (0, 1)]  # fmt: skip
    try:
        base = f"http://{net.hosts[0].ip}:{HTTP_PORT}"
        urls = [f"{base}/health", f"http://{net.hosts[1].ip}:{HTTP_PORT + 1}/health"]
        r = net.run(0, [sys.executable, CLIENT, "wait", *urls, "--timeout", "300"], timeout=320)
        assert r.returncode == 0, nodes[0].log()[-3000:] + nodes[1].log()[-3000:]
        r = net.run(0, [sys.executable, __file__, "client", base, str(args.concurrency), str(args.output_len)],
                    timeout=900)  # fmt: skip
        assert r.returncode == 0, r.stderr[-3000:]
        out = json.loads(r.stdout.strip().splitlines()[-1])
        split = re.findall(r"layer partition \[([\d, ]+)\]|layer split over nodes: ([\d,]+)", nodes[0].log())
        out["split"] = next((a or b for a, b in split), "?")
        measured = re.findall(r"measured itself in ([\d.]+)s", nodes[0].log() + nodes[1].log())
        out["measure_s"] = [float(s) for s in measured]
        return out
    finally:
        for nd in nodes:
            nd.stop()


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "client":
        client(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--log-dir", help="keep the nodes' logs here (default: a temporary directory)")
    p.add_argument("--also", nargs="*", default=[], help="more splits to serve beside the two, e.g. 20,10")
    args = p.parse_args()
    SPLITS["measured"] += ["--pp-auto-input-len", "10", "--pp-auto-output-len", str(args.output_len)]
    SPLITS.update({s: ["--pp-layer-partition", s] for s in args.also})
    from netns import NetHosts, netns_unavailable

    if (why := netns_unavailable()) is not None:
        sys.exit(f"bench_unlike_nodes: {why}")
    rows: dict[str, list[dict]] = {k: [] for k in SPLITS}
    with tempfile.TemporaryDirectory() as tmp, NetHosts(2, Path(args.log_dir or tmp)) as net:
        net.spawn(1, ["taskset", "-c", "1", sys.executable, "-c", "while True: pass"], "busy")  # node 1's neighbour
        for i in range(args.rounds):
            order = list(SPLITS) if i % 2 == 0 else list(reversed(SPLITS))
            for name in order:
                row = serve_round(net, name, args)
                rows[name].append(row)
                print(f"round {i + 1} {name:8s}: split {row['split']}, {row['tok_s']:.1f} tok/s, measured in "
                      f"{row['measure_s']} s", flush=True)  # fmt: skip
    med = {k: statistics.median(r["tok_s"] for r in v) for k, v in rows.items()}
    same = all(a["texts"] == b["texts"] for a, b in zip(rows["default"], rows["measured"], strict=True))
    print(f"median tok/s: default {med['default']:.1f}, measured {med['measured']:.1f}: "
          f"{med['measured'] / med['default']:.2f}x; greedy texts identical: {same}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
