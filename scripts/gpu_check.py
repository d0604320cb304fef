"""The body of scripts/gpu_check.sh: ringsched on this machine's GPUs against its CPU and against plain PyTorch.

1. Greedy: the same prompts through ringsched on the CPU (float32) and on CUDA (float32, TF32 off, so the two
   compute the same function): PP=1 with CUDA graphs (the default) and with --enforce-eager, and with two GPUs or
   more PP=2 and TP=2. Random weights have near-ties, so the check reports matching tokens out of the total
   instead of failing on the first difference.
2. The op counter (`bench/op_count.py`) on CUDA: launches per decode layer with the Triton layer ops and with
   torch's operators, and the host waits between a step's first launch and its sampled tokens.
3. Speed: TPOT at one request and output tokens/s at `--concurrency` requests, ringsched PP=1 (CUDA graphs,
   --enforce-eager, the plain torch attention) against transformers' `AutoModelForCausalLM.generate` (eager,
   greedy) on the same weights, GPU and dtype; and with `--big-model` (an 8B model's shape, 4 layers) ringsched
   with and without graphs.

Prints one table (and writes it to `--out`). The timings are benchmark output, not tests.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
import traceback
from pathlib import Path

import torch

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,",
           "The quick brown fox", "Water boils at", "In 1492,", "import numpy as np"]  # fmt: skip


def ringsched_greedy(model: str, prompts: list[str], max_tokens: int, **kw) -> list[list[int]]:
    from ringsched import Engine, SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    with Engine(model=model, dtype="float32", kv_cache_memory="2G", **kw) as llm:
        return [r.token_ids for r in llm.generate(prompts, params)]


def op_count(model: str) -> str:
    from ringsched.bench.op_count import count_decode_ops

    fused, plain = (count_decode_ops(model, fused=f, device="cuda") for f in (True, False))
    return (f"{fused['launches_per_layer']:g} launches with the Triton layer ops, {plain['launches_per_layer']:g} "
            f"with torch's; {len(fused['waits'])} host waits ({', '.join(fused['waits']) or 'none'})")  # fmt: skip


def matching(ref: list[list[int]], got: list[list[int]]) -> tuple[int, int]:
    """Tokens equal to the reference up to each row's first difference (after it the contexts differ)."""
    same = 0
    for a, b in zip(ref, got, strict=True):
        for x, y in zip(a, b, strict=False):
            if x != y:
                break
            same += 1
    return same, sum(len(a) for a in ref)


def ringsched_speed(model: str, dtype: str, prompt: list[int], out_len: int, concurrency: int,
                    **kw) -> tuple[float, float]:  # fmt: skip
    """(TPOT in ms at one request, output tokens/s at `concurrency` requests)."""
    from ringsched import Engine, SamplingParams

    def run(llm, n: int, tokens: int) -> float:
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        llm.generate([prompt] * n, params)
        return time.perf_counter() - start

    with Engine(model=model, dtype=dtype, device="cuda", kv_cache_memory="8G",
                max_running_requests=max(concurrency, 1), **kw) as llm:  # fmt: skip
        run(llm, 2, 8)  # warm-up
        tpot = (run(llm, 1, out_len + 1) - run(llm, 1, 1)) / out_len
        return tpot * 1e3, concurrency * out_len / run(llm, concurrency, out_len)


def eager_speed(model: str, dtype: str, prompt: list[int], out_len: int, concurrency: int) -> tuple[float, float]:
    """The same two numbers for transformers' eager `generate` on the same GPU."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).to("cuda").eval()

    def run(n: int, tokens: int) -> float:
        ids = torch.tensor([prompt] * n, device="cuda")  # [n, len]: one length, no padding
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                        min_new_tokens=tokens, do_sample=False, pad_token_id=0)  # fmt: skip
        torch.cuda.synchronize()
        return time.perf_counter() - start

    run(2, 8)  # warm-up
    tpot = (run(1, out_len + 1) - run(1, 1)) / out_len
    return tpot * 1e3, concurrency * out_len / run(concurrency, out_len)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a model directory (config.json, model.safetensors, tokenizer)")
    ap.add_argument("--big-model", default=None, help="a second model directory, timed by ringsched only")
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per prompt")
    ap.add_argument("--out-len", type=int, default=128, help="output tokens per request in the speed runs")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--bench-dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--out", type=Path, default=None, help="also write the table here")
    args = ap.parse_args()
    os.environ["RINGSCHED_TF32"] = "0"  # the stages inherit it: float32 on CUDA computes as on the CPU
    rows: list[tuple[str, str]] = []

    def check(name: str, fn) -> None:
        try:
            rows.append((name, fn()))
        except Exception as e:  # one failing row must not hide the others
            traceback.print_exc()
            rows.append((name, f"FAILED: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:160]))
        print(f"{rows[-1][0]}: {rows[-1][1]}", flush=True)

    ref = ringsched_greedy(args.model, PROMPTS, args.max_tokens, device="cpu")
    layouts = [("PP=1", {}), ("PP=1 --enforce-eager", {"enforce_eager": True})]
    layouts += [("PP=1 torch attention", {"attention_backend": "torch"})]
    layouts += [("PP=2", {"pp_size": 2}), ("TP=2", {"tp_size": 2})] if args.gpus >= 2 else []
    for name, kw in layouts:
        def greedy(kw=kw) -> str:
            same, total = matching(ref, ringsched_greedy(args.model, PROMPTS, args.max_tokens, device="cuda", **kw))
            return f"{same}/{total} tokens match the CPU (float32, TF32 off)"

        check(f"greedy {name} cuda vs cpu", greedy)
    check("op count, a decode layer", lambda: op_count(args.model))
    os.environ["RINGSCHED_TF32"] = "1"
    prompt = list(range(300, 300 + 32))  # 32 prompt tokens (ids every vocabulary of interest has)
    speeds = {}
    eager = functools.partial(ringsched_speed, enforce_eager=True)
    torch_attention = functools.partial(ringsched_speed, attention_backend="torch")
    runs = [("ringsched PP=1", ringsched_speed, args.model), ("ringsched PP=1 --enforce-eager", eager, args.model),
            ("ringsched PP=1 torch attention", torch_attention, args.model),
            ("transformers eager", eager_speed, args.model)]  # fmt: skip
    if args.big_model:
        runs += [("big model, ringsched PP=1", ringsched_speed, args.big_model),
                 ("big model, ringsched PP=1 --enforce-eager", eager, args.big_model)]  # fmt: skip
    for name, fn, model in runs:
        def speed(fn=fn, name=name, model=model) -> str:
            tpot, tput = speeds[name] = fn(model, args.bench_dtype, prompt, args.out_len, args.concurrency)
            return f"TPOT {tpot:.2f} ms at 1 request; {tput:.0f} output tok/s at {args.concurrency}"

        check(f"{name} ({args.bench_dtype})", speed)
    if "ringsched PP=1" in speeds and "transformers eager" in speeds:
        (t_r, s_r), (t_e, s_e) = speeds["ringsched PP=1"], speeds["transformers eager"]
        rows.append(("ringsched / eager", f"TPOT {t_r / t_e:.2f}x; throughput {s_r / s_e:.2f}x"))
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    report(f"gpu_check: {args.gpus} x {gpu}, torch {torch.__version__}, model {args.model}", rows, args.out)
    return 1 if any(v.startswith("FAILED") for _, v in rows) else 0


def report(title: str, rows: list[tuple[str, str]], out: Path | None) -> None:
    """The rows as one table under `title`, to stdout and to `out` when given."""
    width = max(len(n) for n, _ in rows)
    table = "\n".join([title] + [f"{n:<{width}}  {v}" for n, v in rows])
    print("\n" + table)
    if out:
        out.write_text(table + "\n")


if __name__ == "__main__":
    sys.exit(main())
