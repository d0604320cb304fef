"""Prefix caching on a shared-prefix workload: the same requests served with and without the cache.

Each round starts a server with `--enable-prefix-caching` and one with `--no-enable-prefix-caching` (the order
rotates) and sends both the same `--dataset shared-prefix` requests at once through `ringsched.bench serve`'s
client: `--num-prompts` prompts behind one `--prefix-len`-token prefix, each with `--suffix-len` tokens of its
own, `--output-len` greedy tokens. It prints median TTFT, output throughput and the cached share per server,
the medians over rounds, the TTFT ratio, and whether the two servers' texts were identical.

    python scripts/bench_prefix_cache.py --rounds 3
    python scripts/bench_prefix_cache.py --server-args "--pp-size 1" --num-prompts 64
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import shlex
import statistics

from ringsched.bench.metrics import compute_metrics
from ringsched.bench.serve import ServeConfig, benchmark, load_requests
from ringsched.bench.server_process import ServerProcess


def one(flags: list[str], cfg: ServeConfig) -> tuple[dict, list[str]]:
    with ServerProcess(flags) as srv:
        warm = ServeConfig(base_url=srv.url, num_prompts=2, random_input_len=16, random_output_len=4, ignore_eos=True,
                           disable_tqdm=True, seed=99)  # fmt: skip
        asyncio.run(benchmark(warm, load_requests(warm)))  # the first forward passes of a fresh server are slow
        run = dataclasses.replace(cfg, base_url=srv.url)
        _, results, duration = asyncio.run(benchmark(run, load_requests(run)))
    failed = [r.error for r in results if not r.success]
    if failed:
        raise SystemExit(f"{len(failed)} requests failed, first: {failed[0]}")
    m = compute_metrics(results, duration)
    return {"ttft_ms": m.ttft.median, "tok_s": m.output_throughput,
            "cached": m.total_cached_tokens / max(m.total_input_tokens, 1)}, [r.text for r in results]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--prefix-len", type=int, default=1000)
    ap.add_argument("--suffix-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--server-args", default="--pp-size 2 --threads-per-stage 1",
                    help="launcher flags for both servers (default: %(default)s)")  # fmt: skip
    args = ap.parse_args()
    cfg = ServeConfig(num_prompts=args.num_prompts, dataset="shared-prefix", shared_prefix_len=args.prefix_len,
                      random_input_len=args.suffix_len, random_output_len=args.output_len, ignore_eos=True,
                      disable_tqdm=True)  # fmt: skip
    base = shlex.split(args.server_args)
    configs = {"cache": base + ["--enable-prefix-caching"], "no cache": base + ["--no-enable-prefix-caching"]}
    got: dict[str, list[dict]] = {k: [] for k in configs}
    same = []
    for r in range(args.rounds):
        texts = {}
        for name in list(configs)[:: 1 if r % 2 == 0 else -1]:
            row, texts[name] = one(configs[name], cfg)
            got[name].append(row)
            print(f"round {r + 1} {name:>8}: median TTFT {row['ttft_ms']:8.1f} ms, {row['tok_s']:6.1f} tok/s, "
                  f"cached {row['cached']:.1%}", flush=True)  # fmt: skip
        same.append(texts["cache"] == texts["no cache"])
    med = {k: {f: statistics.median(x[f] for x in rows) for f in rows[0]} for k, rows in got.items()}
    print(f"\n| {args.server_args} | median TTFT (ms) | output tok/s | cached share |\n| --- | --- | --- | --- |")
    for k, m in med.items():
        print(f"| {k} | {m['ttft_ms']:.0f} | {m['tok_s']:.1f} | {m['cached']:.1%} |")
    ratios = [n["ttft_ms"] / c["ttft_ms"] for c, n in zip(got["cache"], got["no cache"], strict=True)]
    print(f"\nTTFT without / with the cache: median {statistics.median(ratios):.2f}x (rounds "
          f"{', '.join(f'{x:.2f}x' for x in ratios)}); texts identical in {sum(same)}/{len(same)} rounds")  # fmt: skip


if __name__ == "__main__":
    main()
