"""The TP-against-PP trade on this machine (docs/performance.md, "Tensor parallelism"): interleaved rounds of
`bench offline`, each round running every configuration once in a rotated order, then medians.

Latency: one request of 16 prompt tokens and 128 new ones, so the time per output token is the run's elapsed
time over 128 (the prefill is one step of 16 tokens). Throughput: many requests at once (`--num-prompts`, 32 + 64
tokens each), PP=1 and TP=2 running 128 at a time, PP=2 256 (128 per micro-batch, as PP=1's batch).

    python scripts/bench_tp.py [--rounds 3] [--num-prompts 256] [--out DIR]
    python scripts/bench_tp.py --model DIR --latency-only --output-len 32   # a bigger model: TP=1 against TP=2
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

CONFIGS = {  # name -> launcher flags
    "TP=1 x PP=1, 1 thread": ["--pp-size", "1", "--threads-per-stage", "1"],
    "TP=1 x PP=1, 2 threads": ["--pp-size", "1", "--threads-per-stage", "2"],
    "TP=2 x PP=1, 1 thread per rank": ["--tp-size", "2", "--threads-per-stage", "1"],
    "TP=1 x PP=2, 1 thread per stage": ["--pp-size", "2", "--threads-per-stage", "1"],
}
SATURATED = list(CONFIGS)[1:]  # the document's three; TP=1 with 1 thread is latency's reference only
LATENCY_PAIR = ("TP=1 x PP=1, 1 thread", "TP=2 x PP=1, 1 thread per rank")


def offline(flags: list[str], out: Path, model: str | None) -> dict:
    model_flags = ["--model", model] if model else []
    cmd = [sys.executable, "-m", "ringsched.bench", "offline", *model_flags, *flags, "--kv-cache-memory", "2G",
           "--json", "--no-efficiency", "--log-level", "warning"]  # fmt: skip
    text = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    out.write_text(text)
    return json.loads(text.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--out", default="bench-tp")
    p.add_argument("--model", default=None, help="default: the launcher's")
    p.add_argument("--output-len", type=int, default=128, help="new tokens of the one-request run")
    p.add_argument("--latency-only", action="store_true", help="TP=1 (1 thread) against TP=2 at one request")
    args = p.parse_args()
    configs = {k: CONFIGS[k] for k in LATENCY_PAIR} if args.latency_only else CONFIGS
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tpot: dict[str, list[float]] = {c: [] for c in configs}
    tput: dict[str, list[float]] = {c: [] for c in SATURATED if c in configs and not args.latency_only}
    wire: dict[str, list] = {}
    names = list(configs)
    for i in range(args.rounds):
        order = names[i % len(names) :] + names[: i % len(names)]
        for k, name in enumerate(order):
            flags = configs[name]
            one = ["--num-prompts", "1", "--input-len", "16", "--output-len", str(args.output_len),
                   "--warmup-prompts", "1"]  # fmt: skip
            r = offline(flags + one, out / f"latency_{i}_{k}.json", args.model)
            tpot[name].append(1000 / r["output_tokens_per_s"])  # one request: elapsed / its tokens
            wire[name] = r["rank_wire"]
            print(f"round {i + 1} {name}: TPOT {tpot[name][-1]:.1f} ms", flush=True)
            if name in tput:
                running = "256" if "PP=2" in name else "128"
                many = ["--num-prompts", str(args.num_prompts), "--input-len", "32", "--output-len", "64",
                        "--max-running-requests", running, "--warmup-prompts", "8"]  # fmt: skip
                r = offline(flags + many, out / f"throughput_{i}_{k}.json", args.model)
                tput[name].append(r["output_tokens_per_s"])
                print(f"round {i + 1} {name}: {tput[name][-1]:.1f} tok/s saturated", flush=True)
    ref = statistics.median(tpot[names[0]])
    print(f"\nmedians of {args.rounds} rounds")
    for name in names:
        t = statistics.median(tpot[name])
        line = f"{name}: TPOT {t:.1f} ms ({t / ref:.2f}x TP=1 with 1 thread)"
        if name in tput:
            line += f", saturated {statistics.median(tput[name]):.1f} tok/s"
        w = wire[name]
        line += "; per rank: " + ", ".join(
            f"r{x['rank']} seam {x['seam_bytes_per_token']:.0f} B/tok, {x['tp_all_reduces_per_batch']:.0f} "
            f"all-reduces/batch ({x['tp_all_reduce_bytes_per_token']:.0f} B/tok)" for x in w
        )  # fmt: skip
        print(line)
    summary = {"tpot_ms": tpot, "output_tokens_per_s": tput, "rank_wire": wire}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
