"""`python -m ringsched.bench offline`: saturate the offline engine with random prompts and report throughput
and each stage's busy fraction (time in compute over the benchmark's wall time)."""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from ringsched.cli_args import add_engine_args, config_from_args, engine_kwargs


def add_offline_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--warmup-prompts", type=int, default=8, help="run first, not measured")
    p.add_argument("--repeat", type=int, default=1, help="measured runs in one engine; medians are reported")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument("--log-level", default="warning")


def _prompts(n: int, length: int, vocab: int, rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(n)]


def _one_run(llm, prompts, params) -> dict:
    before = {r: dict(s) for r, s in llm.supervisor.stats.items()}
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    time.sleep(0.7)  # one more stats report from every stage
    llm.poll(0.05)
    after = llm.supervisor.stats
    busy = [(after[r]["compute_s"] - before.get(r, {}).get("compute_s", 0.0)) / elapsed for r in sorted(after)]
    tokens = sum(len(o.token_ids) for o in outs)
    return {"elapsed_s": elapsed, "output_tokens": tokens, "output_tokens_per_s": tokens / elapsed,
            "requests_per_s": len(outs) / elapsed, "stage_busy_fraction": busy}


def run_offline(args: argparse.Namespace) -> dict:
    cfg = config_from_args(args, log_level=args.log_level)
    from ringsched.engine import Engine
    from ringsched.models.config import ModelConfig
    from ringsched.sampling import SamplingParams

    vocab = ModelConfig.from_dir(cfg.model).vocab_size
    rng = random.Random(cfg.seed)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    kwargs = engine_kwargs(cfg)
    with Engine(model=cfg.model, **kwargs) as llm:
        if args.warmup_prompts:
            llm.generate(_prompts(args.warmup_prompts, args.input_len, vocab, rng), params)
        runs = [_one_run(llm, _prompts(args.num_prompts, args.input_len, vocab, rng), params)
                for _ in range(args.repeat)]
        partition = cfg.partition(ModelConfig.from_dir(cfg.model).num_layers)
    med = {k: statistics.median(r[k] for r in runs) for k in ("output_tokens_per_s", "requests_per_s", "elapsed_s")}
    busy = [statistics.median(r["stage_busy_fraction"][i] for r in runs) for i in range(cfg.pp_size)]
    result = {
        "pp_size": cfg.pp_size, "threads_per_stage": cfg.threads, "pp_async_batch_depth": cfg.pp_async_batch_depth,
        "partition": partition, "num_prompts": args.num_prompts, "input_len": args.input_len,
        "output_len": args.output_len, "dtype": cfg.dtype, **med, "stage_busy_fraction": busy, "runs": runs,
    }  # fmt: skip
    print(f"pp={cfg.pp_size} threads/stage={cfg.threads} depth={cfg.pp_async_batch_depth} partition={partition}")
    print(f"  output tokens/s: {med['output_tokens_per_s']:.1f}   requests/s: {med['requests_per_s']:.3f}   "
          f"elapsed: {med['elapsed_s']:.1f}s (median of {len(runs)})")
    print("  stage busy fraction: " + ", ".join(f"stage {i}: {b:.1%}" for i, b in enumerate(busy)))
    if args.json:
        print(json.dumps(result))
    return result
