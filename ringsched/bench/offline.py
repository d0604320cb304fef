"""`python -m ringsched.bench offline`: saturate the offline engine with random prompts and report throughput,
where each stage's time went (compute, waiting on a neighbour, scheduling, communication), its model FLOP/s
against a plain matmul of the same shapes measured beside it, and its peak memory against its budget."""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import time

from ringsched.bench import long_prompt
from ringsched.bench.efficiency import FlopModel, efficiency, matmul_gflops, mean_context, stage_flops
from ringsched.bench.memory import format_memory, stage_memory
from ringsched.bench.stage_metrics import settled
from ringsched.config import EngineConfig
from ringsched.process.cli_args import add_engine_args, config_from_args, engine_kwargs

TIME_KEYS = ("compute_s", "wait_s", "sched_s", "comm_s")
COUNT_KEYS = ("batches", "tokens", "layer_tokens", "sample_rows", "head_s")  # head_s: part of compute_s
# What each rank sent across its seam and all-reduced over its stage's tensor-parallel ranks (cumulative).
WIRE_KEYS = ("seam_bytes_sent", "seam_tokens_sent", "tp_all_reduces", "tp_all_reduce_bytes")


def add_offline_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    p.set_defaults(pp_auto_input_len=None, pp_auto_output_len=None)  # unset: this run's --input/output-len
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--warmup-prompts", type=int, default=8, help="run first, not measured")
    p.add_argument("--repeat", type=int, default=1, help="measured runs in one engine; medians are reported")
    p.add_argument(
        "--efficiency",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="after the run, time a plain matmul of the model's shapes to compare FLOP/s (~3 s)",
    )
    p.add_argument(
        "--long-prompt",
        type=int,
        default=None,
        metavar="N",
        help="instead: time the first token of one N-token prompt (--repeat times, one at a time)",
    )
    p.add_argument(
        "--long-output",
        type=int,
        default=1,
        metavar="M",
        help="with --long-prompt: generate M tokens after it and report their TPOT (decodes at that context)",
    )
    p.add_argument(
        "--decoding-streams",
        type=int,
        default=0,
        metavar="K",
        help="with --long-prompt: K streams of --input-len tokens decode first; report their TPOT "
        "before and while the long prompt prefills",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument("--log-level", default="warning")


def _prompts(n: int, length: int, vocab: int, rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(n)]


def _fresh_stats(llm) -> dict[int, dict]:
    """Every stage's stats once every time and count has stopped moving (`stage_metrics.settled`)."""

    def read() -> dict[int, dict]:
        llm.poll(0.05)
        return {r: dict(s) for r, s in llm.supervisor.stats.items()}

    def moved(a: dict[int, dict], b: dict[int, dict]) -> bool:
        return a.keys() != b.keys() or any(a[r].get(k) != b[r].get(k) for r in a for k in TIME_KEYS + COUNT_KEYS)

    return settled(read, moved)


def _stage_deltas(before: dict[int, dict], after: dict[int, dict]) -> list[dict]:
    """Per rank (in rank order), what the run added to each time and count."""
    keys = TIME_KEYS + COUNT_KEYS + WIRE_KEYS + ("wall_s",)
    return [{k: after[r].get(k, 0) - before.get(r, {}).get(k, 0) for k in keys} for r in sorted(after)]


def wire_per_rank(deltas: list[dict], info: dict[int, dict]) -> list[dict]:
    """Each rank's traffic per token: seam bytes sent (2 x hidden x dtype bytes / tp where a seam follows), and
    the all-reduces per micro-batch and their bytes per token."""
    out = []
    for r, d in zip(sorted(info), deltas, strict=True):
        out.append(
            {
                "rank": r,
                "stage": info[r].get("stage", r),
                "tp": info[r].get("tp", 0),
                "seam_bytes_per_token": d["seam_bytes_sent"] / max(d["seam_tokens_sent"], 1),
                "tp_all_reduces_per_batch": d["tp_all_reduces"] / max(d["batches"], 1),
                "tp_all_reduce_bytes_per_token": d["tp_all_reduce_bytes"] / max(d["tokens"], 1),
            }
        )
    return out


def _one_run(llm, prompts, params, before: dict[int, dict]) -> tuple[dict, dict[int, dict]]:
    """One measured run; returns its figures and the stats after it (the next run's `before`)."""
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    after = _fresh_stats(llm)
    deltas = _stage_deltas(before, after)
    # of the stage's own window between the two stats snapshots where longer than the run (a short run: the
    # snapshots' edges are a noticeable share of it)
    fractions = [{k.removesuffix("_s"): d[k] / max(elapsed, d["wall_s"]) for k in TIME_KEYS} for d in deltas]
    tokens = sum(len(o.token_ids) for o in outs)
    run = {
        "elapsed_s": elapsed,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / elapsed,
        "requests_per_s": len(outs) / elapsed,
        "stage_busy_fraction": [f["compute"] for f in fractions],
        "stage_time_fractions": fractions,
        "stage_deltas": deltas,
    }
    return run, after


def _median_per_stage(per_run: list[list[dict]]) -> list[dict]:
    """Per stage and key, the median over runs."""
    return [{k: statistics.median(run[i][k] for run in per_run) for k in per_run[0][i]} for i in range(len(per_run[0]))]


def _efficiency(cfg, mcfg, runs: list[dict], partition: list[int], input_len: int, output_len: int) -> dict:
    """Model FLOP/s per stage, the matmul reference (the engine has exited: nothing competes) and their ratio."""
    flops = FlopModel.of(mcfg, mean_context(input_len, output_len))
    per_stage = _median_per_stage([stage_flops(r["stage_deltas"], partition, flops, r["elapsed_s"]) for r in runs])
    first = [r["stage_deltas"][0] for r in runs]
    rows = sum(d["tokens"] for d in first) / max(sum(d["batches"] for d in first), 1)
    device = "cuda:0" if cfg.resolved_device == "cuda" else "cpu"
    ref = matmul_gflops(round(rows), mcfg, cfg.torch_dtype, cfg.threads, device)
    return {
        "flop_model": dataclasses.asdict(flops),
        "stage_flops": per_stage,
        "matmul_reference": ref,
        "efficiency": efficiency(per_stage, ref["gflops_per_s"]),
    }


def offline_config(args: argparse.Namespace) -> EngineConfig:
    """The engine config; `auto` balances for the requests this benchmark sends unless told otherwise."""
    if args.pp_auto_input_len is None:
        args.pp_auto_input_len = args.input_len
    if args.pp_auto_output_len is None:
        args.pp_auto_output_len = args.output_len
    return config_from_args(args, log_level=args.log_level)


def run_offline(args: argparse.Namespace) -> dict:
    cfg = offline_config(args)
    from ringsched.engine import Engine
    from ringsched.sampling.params import SamplingParams
    from ringsched.weights.model_config import ModelConfig

    mcfg = ModelConfig.from_dir(cfg.model)
    rng = random.Random(cfg.seed)
    if args.long_prompt is not None:
        return _run_long_prompt(args, cfg, mcfg, rng)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    with Engine(model=cfg.model, **engine_kwargs(cfg)) as llm:
        if args.warmup_prompts:
            llm.generate(_prompts(args.warmup_prompts, args.input_len, mcfg.vocab_size, rng), params)
        before, runs = _fresh_stats(llm), []
        for _ in range(args.repeat):
            run, before = _one_run(
                llm, _prompts(args.num_prompts, args.input_len, mcfg.vocab_size, rng), params, before
            )
            runs.append(run)
        info = {r: dict(i) for r, i in llm.supervisor.info.items()}
    result = _summary(args, cfg, runs, before, info)
    partition = result["partition"]
    if args.efficiency and cfg.tp_size > 1:
        print("  (model FLOP/s efficiency is computed per stage at --tp-size 1 only)")
    elif args.efficiency:
        result |= _efficiency(cfg, mcfg, runs, partition, args.input_len, args.output_len)
    _print_report(result, len(runs))
    if args.json:
        print(json.dumps(result))
    return result


def _summary(args: argparse.Namespace, cfg, runs: list[dict], before: dict, info: dict) -> dict:
    """The runs' medians, per stage its first rank's figures (a stage's ranks run the same plans in step); the
    partition as run (`auto` decided; with --pp-flex-layers, the partition the cut moves around, not the layers
    held)."""
    firsts = [i for i, r in enumerate(sorted(info)) if info[r].get("tp", 0) == 0]
    leaders = [sorted(info)[i] for i in firsts]
    partition = [info[r].get("cut_layers", info[r]["layers"][1] - info[r]["layers"][0]) for r in leaders]
    med = {k: statistics.median(r[k] for r in runs) for k in ("output_tokens_per_s", "requests_per_s", "elapsed_s")}
    busy = [statistics.median(r["stage_busy_fraction"][i] for r in runs) for i in firsts]
    fractions = _median_per_stage([r["stage_time_fractions"] for r in runs])
    return {
        "pp_size": cfg.pp_size,
        "tp_size": cfg.tp_size,
        "threads_per_stage": cfg.threads,
        "pp_async_batch_depth": cfg.pp_async_batch_depth,
        "partition": partition,
        "pp_flex_layers": cfg.pp_flex_layers,
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "dtype": cfg.dtype,
        **med,
        "stage_busy_fraction": busy,
        "stage_time_fractions": [fractions[i] for i in firsts],
        "stage_memory": [stage_memory(before[r], info[r]) for r in leaders],
        "rank_memory": [stage_memory(before[r], info[r]) for r in sorted(info)],
        "rank_wire": wire_per_rank(_median_per_stage([r["stage_deltas"] for r in runs]), info),
        "runs": runs,
    }


def _run_long_prompt(args, cfg, mcfg, rng: random.Random) -> dict:
    from ringsched.engine import Engine

    if args.long_prompt < 1 or args.decoding_streams < 0:
        raise SystemExit("error: --long-prompt must be >= 1 and --decoding-streams >= 0")
    with Engine(model=cfg.model, **engine_kwargs(cfg)) as llm:
        if args.warmup_prompts:
            long_prompt.time_long_prompts(llm, min(args.long_prompt, 256), 1, mcfg.vocab_size, rng)
        if args.decoding_streams:
            result = long_prompt.decodes_beside_a_long_prompt(
                llm, args.long_prompt, args.decoding_streams, args.input_len, mcfg.vocab_size, rng
            )
        else:
            result = long_prompt.time_long_prompts(
                llm, args.long_prompt, args.repeat, mcfg.vocab_size, rng, output_len=max(args.long_output, 1)
            )
    result |= {
        "pp_size": cfg.pp_size,
        "tp_size": cfg.tp_size,
        "cp_size": cfg.cp_size,
        "threads_per_stage": cfg.threads,
        "chunked_prefill_size": cfg.chunked_prefill_size,
        "dynamic_chunking": cfg.enable_dynamic_chunking,
        "dtype": cfg.dtype,
    }
    long_prompt.print_long_prompt(result, cfg)
    if args.json:
        print(json.dumps(result))
    return result


def _print_report(r: dict, n_runs: int) -> None:
    print(
        f"pp={r['pp_size']} tp={r['tp_size']} threads/rank={r['threads_per_stage']} "
        f"depth={r['pp_async_batch_depth']} partition={r['partition']}"
    )
    print(
        f"  output tokens/s: {r['output_tokens_per_s']:.1f}   requests/s: {r['requests_per_s']:.3f}   "
        f"elapsed: {r['elapsed_s']:.1f}s (median of {n_runs})"
    )
    print("  stage busy fraction: " + ", ".join(f"stage {i}: {b:.1%}" for i, b in enumerate(r["stage_busy_fraction"])))
    if "matmul_reference" in r:
        ref = r["matmul_reference"]
        print(
            f"  matmul reference: [{ref['rows']}, {ref['hidden']}] x [{ref['intermediate']}, {ref['hidden']}] "
            f"{r['dtype']}, {ref['threads']} thread(s): {ref['gflops_per_s']:.1f} GFLOP/s"
        )
    for i, (f, mem) in enumerate(zip(r["stage_time_fractions"], r["stage_memory"], strict=True)):
        parts = [" ".join(f"{k} {v:.0%}" for k, v in f.items())]
        if "efficiency" in r:
            s, ref = r["stage_flops"][i], r["matmul_reference"]["gflops_per_s"]
            parts.append(f"{s['gflops_per_s_wall']:.1f} GFLOP/s model (matmul {ref:.1f}) = {r['efficiency'][i]:.0%}")
        parts.append(format_memory(mem))
        print(f"  stage {i}: " + " | ".join(parts))
    for w, mem in zip(r["rank_wire"], r["rank_memory"], strict=True):
        if r["tp_size"] > 1 or r["pp_size"] > 1:
            print(
                f"  rank {w['rank']} (stage {w['stage']}, tp {w['tp']}): seam "
                f"{w['seam_bytes_per_token']:.0f} B/token, {w['tp_all_reduces_per_batch']:.0f} all-reduces/batch = "
                f"{w['tp_all_reduce_bytes_per_token']:.0f} B/token | {format_memory(mem)}"
            )
