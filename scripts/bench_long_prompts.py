"""TTFT of single long prompts against their length, per configuration, in interleaved rounds: one engine per
configuration and round (configurations in rotated order each round), every length once per engine; medians
over the rounds. Writes JSON, a Markdown table (with each configuration's ratio to the first) and a plot.

    python scripts/bench_long_prompts.py --lengths 1000,2000,4000,6000,8000 --rounds 1 \\
        --config pp=1 --config pp=2 --config pp=2,dynamic --config pp=1,cp=2 --out docs/long_prompt_ttft
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys

from ringsched.bench.long_prompt import time_long_prompts
from ringsched.engine import Engine
from ringsched.weights.model_config import ModelConfig


def parse_config(text: str) -> dict:
    kw: dict = {}
    for part in text.split(","):
        key, _, value = part.partition("=")
        if key == "pp":
            kw["pp_size"] = int(value)
        elif key == "cp":
            kw["cp_size"] = int(value)
        elif key == "dynamic":
            kw["enable_dynamic_chunking"] = True
        elif key == "chunk":
            kw["chunked_prefill_size"] = int(value)
        elif key == "threads":
            kw["threads_per_stage"] = int(value)
        else:
            raise SystemExit(f"error: --config {text!r}: unknown key {key!r} (pp=N, cp=N, dynamic, chunk=N, threads=N)")
    return kw


def label(kw: dict) -> str:
    parts = [f"PP={kw.get('pp_size', 1)}"] + ([f"CP={kw['cp_size']}"] if kw.get("cp_size", 1) > 1 else [])
    parts += ["dynamic" if kw.get("enable_dynamic_chunking") else "fixed"]
    if "chunked_prefill_size" in kw:
        parts.append(f"chunk {kw['chunked_prefill_size']}")
    if kw.get("threads_per_stage", 1) != 1:
        parts.append(f"{kw['threads_per_stage']} threads")
    return " ".join(parts)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="1000,2000,4000,6000,8000")
    p.add_argument("--config", action="append", required=True, help="pp=N[,cp=N][,dynamic][,chunk=N][,threads=N]")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--out", default=None, help="write OUT.json, OUT.md and OUT.png")
    args = p.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    configs = [parse_config(c) for c in args.config]
    times: dict[int, dict[int, list[float]]] = {i: {n: [] for n in lengths} for i in range(len(configs))}
    rng = random.Random(0)
    vocab = None
    for rnd in range(args.rounds):
        order = [(rnd + k) % len(configs) for k in range(len(configs))]
        for i in order:
            kw = {"threads_per_stage": 1, "kv_cache_memory": "1G", "log_level": "warning", **configs[i]}
            with Engine(model=args.model, **kw) as llm:
                vocab = vocab or ModelConfig.from_dir(llm.cfg.model).vocab_size
                time_long_prompts(llm, 256, 1, vocab, rng)  # warm up
                for n in lengths:
                    t = time_long_prompts(llm, n, 1, vocab, rng)["ttft_s"]
                    times[i][n].append(t)
                    print(f"round {rnd + 1} {label(configs[i])} {n} tokens: TTFT {t:.2f} s", flush=True)
    med = {i: {n: statistics.median(ts) for n, ts in by.items()} for i, by in times.items()}
    head = "| prompt tokens | " + " | ".join(label(c) for c in configs) + " |"
    rows = [head, "|" + " --- |" * (len(configs) + 1)]
    for n in lengths:
        cells = [f"{med[0][n]:.2f} s"] + [f"{med[i][n]:.2f} s ({med[i][n] / med[0][n]:.2f}x)"
                                         for i in range(1, len(configs))]  # fmt: skip
        rows.append(f"| {n} | " + " | ".join(cells) + " |")
    table = "\n".join(rows)
    print(table)
    if args.out:
        record = {"lengths": lengths, "configs": [label(c) for c in configs], "rounds": args.rounds,
                  "ttft_s": {label(configs[i]): {str(n): ts for n, ts in by.items()} for i, by in times.items()}}
        with open(args.out + ".json", "w") as f:
            json.dump(record, f, indent=1)
        with open(args.out + ".md", "w") as f:
            f.write(table + "\n")
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for i, c in enumerate(configs):
            ax.plot(lengths, [med[i][n] for n in lengths], marker="o", label=label(c))
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel(f"TTFT, s (median of {args.rounds})")
        ax.set_title("One long prompt, SmolLM2, 1 thread per rank")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.out + ".png", dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main())
