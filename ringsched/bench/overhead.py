"""`python -m ringsched.bench overhead`: the engine's own work per step, on a model whose compute is nearly nothing.

It writes a random-weight model (hidden 64, one head, a 512-token vocabulary; 30 layers and 2 layers by default) to
the cache, runs the offline engine at each `--pp` with one thread a stage, and times greedy decoding at each row
count: ms a step (a step: every running request gets one token), us a row-step, tok/s. A step's time is the
difference of two runs that differ only in their output length, so prefill and start-up cancel out; each figure is
the median of `--repeat` such pairs. With `--ops`, it also counts the aten ops of one decode step of the device
path (`bench/op_count.py`)."""

from __future__ import annotations

import argparse
import json
import statistics
import time

from ringsched.cache_dir import cache_dir
from ringsched.models.random_model import random_config, write_random_model

HIDDEN, VOCAB, INTERMEDIATE, PROMPT_LEN = 64, 512, 256, 8


def add_overhead_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layers", type=int, nargs="+", default=[30, 2], help="the models' layer counts")
    p.add_argument("--pp", type=int, nargs="+", default=[1, 2], help="pipeline sizes to run")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 128], help="concurrent requests")
    p.add_argument("--steps", type=int, default=64, help="decode steps the longer run adds over the shorter")
    p.add_argument("--repeat", type=int, default=3, help="timed pairs per figure; the median is reported")
    p.add_argument("--ops", action="store_true", help="also count the ops of one decode step (the device path)")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")


def overhead_model(layers: int) -> str:
    """The near-zero-compute model of `layers` layers, written once under the cache."""
    out = cache_dir() / "models" / f"overhead-l{layers}-h{HIDDEN}"
    if not (out / "model.safetensors").exists():
        cfg = random_config("llama", layers, HIDDEN, 1, 1, INTERMEDIATE, VOCAB, tie=False, max_len=4096)
        write_random_model(out, cfg)
    return str(out)


def _step_ms(llm, rows: int, steps: int, repeat: int) -> float:
    """Median over `repeat` pairs of (time of `steps + 8` tokens - time of 8 tokens) / steps, in ms."""
    from ringsched.sampling.params import SamplingParams

    prompts = [[100 + (i * 7 + j) % 300 for j in range(PROMPT_LEN)] for i in range(rows)]

    def run(n: int) -> float:
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate(prompts, params)
        return time.perf_counter() - t0

    run(8)  # warm-up: this row count's first batches
    pairs = []
    for _ in range(repeat):
        short, long_ = run(8), run(8 + steps)
        pairs.append((long_ - short) / steps * 1e3)
    return statistics.median(pairs)


def measure(layers: int, pp: int, rows: list[int], steps: int, repeat: int) -> list[dict]:
    from ringsched.engine import Engine

    most = max(rows)
    kw = dict(pp_size=pp, threads_per_stage=1, max_running_requests=most, max_model_len=512)
    out = []
    with Engine(model=overhead_model(layers), log_level="warning", **kw) as llm:
        for n in rows:
            ms = _step_ms(llm, n, steps, repeat)
            out.append({"layers": layers, "pp": pp, "rows": n, "ms_per_step": ms, "us_per_row_step": ms * 1e3 / n})
            out[-1]["tok_per_s"] = n / ms * 1e3
    return out


def _print_table(rows: list[dict]) -> None:
    print("| layers | PP | rows | ms a step | us a row-step | tok/s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['layers']} | {r['pp']} | {r['rows']} | {r['ms_per_step']:.2f} | {r['us_per_row_step']:.0f} "
            f"| {r['tok_per_s']:.0f} |"
        )


def run_overhead(args: argparse.Namespace) -> dict:
    result: dict = {"steps": []}
    for layers in args.layers:
        for pp in args.pp:
            result["steps"] += measure(layers, pp, args.rows, args.steps, args.repeat)
    _print_table(result["steps"])
    if args.ops:
        from ringsched.bench.op_count import count_decode_ops, print_ops

        result["ops"] = [count_decode_ops(overhead_model(max(args.layers)), fused=f) for f in (False, True)]
        for ops in result["ops"]:
            print_ops(ops)
    if args.json:
        print(json.dumps(result))
    return result
