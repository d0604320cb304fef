"""Speculative decoding against none, on the workloads the issue names: the same requests served by a server with
`--speculative-config` and one without (the order rotates per round).

Per server: `--dataset copy` at one request at a time (TPOT: a ~400-token passage repeated or lightly edited), random
prompts at one request at a time (TPOT) and at `--concurrency` (output throughput). It prints each round's
figures, the medians, the ratios with / without, the drafts' acceptance (from `/metrics`) and whether the two
servers' texts were identical (greedy: they must be).

    python scripts/bench_speculative.py --rounds 3
    python scripts/bench_speculative.py --spec '{"method": "suffix", "num_speculative_tokens": 8}'
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
from ringsched.bench.stage_metrics import speculation, speculation_between


def workloads(args) -> dict[str, ServeConfig]:
    common = {"ignore_eos": True, "disable_tqdm": True}
    return {
        "copy c=1": ServeConfig(num_prompts=args.copy_prompts, dataset="copy", random_input_len=400,
                                random_output_len=args.copy_output_len, max_concurrency=1, **common),
        "random c=1": ServeConfig(num_prompts=args.copy_prompts, random_input_len=128, random_output_len=128,
                                  max_concurrency=1, **common),
        f"random c={args.concurrency}": ServeConfig(num_prompts=args.concurrency, random_input_len=128,
                                                    random_output_len=128, max_concurrency=args.concurrency, **common),
    }  # fmt: skip


def one(flags: list[str], loads: dict[str, ServeConfig]) -> tuple[dict, dict]:
    rows, texts = {}, {}
    with ServerProcess(flags) as srv:
        warm = ServeConfig(base_url=srv.url, num_prompts=2, random_input_len=16, random_output_len=4, ignore_eos=True,
                           disable_tqdm=True, seed=99)  # fmt: skip
        asyncio.run(benchmark(warm, load_requests(warm)))  # the first forward passes of a fresh server are slow
        for name, cfg in loads.items():
            run = dataclasses.replace(cfg, base_url=srv.url)
            before = speculation(srv.url)
            _, results, duration = asyncio.run(benchmark(run, load_requests(run)))
            failed = [r.error for r in results if not r.success]
            if failed:
                raise SystemExit(f"{name}: {len(failed)} requests failed, first: {failed[0]}")
            m = compute_metrics(results, duration)
            spec = speculation_between(before, speculation(srv.url))
            rows[name] = {"tpot_ms": m.tpot.median, "tok_s": m.output_throughput,
                          "accepted": spec.get("spec_acceptance_rate", 0.0),
                          "length": spec.get("spec_mean_accepted_length", 0.0)}  # fmt: skip
            texts[name] = [r.text for r in results]
    return rows, texts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--copy-prompts", type=int, default=4)
    ap.add_argument("--copy-output-len", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--spec", default='{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, '
                    '"prompt_lookup_max": 5}', help="the --speculative-config of the server with drafts")  # fmt: skip
    ap.add_argument("--server-args", default="--pp-size 2 --threads-per-stage 1",
                    help="launcher flags for both servers (default: %(default)s)")  # fmt: skip
    args = ap.parse_args()
    loads = workloads(args)
    base = shlex.split(args.server_args)
    configs = {"drafts": base + ["--speculative-config", args.spec], "none": base}
    got: dict[str, list[dict]] = {k: [] for k in configs}
    same = []
    for r in range(args.rounds):
        texts = {}
        for name in list(configs)[:: 1 if r % 2 == 0 else -1]:
            rows, texts[name] = one(configs[name], loads)
            got[name].append(rows)
            for load, row in rows.items():
                print(f"round {r + 1} {name:>6} {load:>12}: TPOT {row['tpot_ms']:7.2f} ms, {row['tok_s']:7.1f} tok/s, "
                      f"acceptance {row['accepted']:.2f}, mean accepted length {row['length']:.2f}", flush=True)
        same.append(texts["drafts"] == texts["none"])
    print(f"\n| {args.server_args} | TPOT ms, none | TPOT ms, drafts | ratio | tok/s, none | tok/s, drafts | ratio | "
          "acceptance | mean accepted length |\n|---|---|---|---|---|---|---|---|---|")
    for load in loads:
        def med(name: str, field: str, load: str = load) -> float:
            return statistics.median(rows[load][field] for rows in got[name])

        pairs = list(zip(got["drafts"], got["none"], strict=True))
        tpot = statistics.median(d[load]["tpot_ms"] / n[load]["tpot_ms"] for d, n in pairs)
        tok = statistics.median(d[load]["tok_s"] / n[load]["tok_s"] for d, n in pairs)
        print(f"| {load} | {med('none', 'tpot_ms'):.2f} | {med('drafts', 'tpot_ms'):.2f} | {tpot:.2f}x | "
              f"{med('none', 'tok_s'):.1f} | {med('drafts', 'tok_s'):.1f} | {tok:.2f}x | "
              f"{med('drafts', 'accepted'):.2f} | {med('drafts', 'length'):.2f} |")
    print(f"\ntexts identical in {sum(same)}/{len(same)} rounds (ratios: medians of the per-round ratios)")


if __name__ == "__main__":
    main()
