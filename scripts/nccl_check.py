"""The NCCL ring on this machine's GPUs (called by scripts/gpu_check.sh; docs/gpu.md): with two GPUs or more one
rank a GPU, with one GPU every rank on it (`RINGSCHED_ONE_GPU=1`).

1. Greedy PP=2 and TP=2 against the CPU (float32, TF32 off), matching tokens out of the total.
2. A PP=3 ring whose seams carry 1, 7, 8 and 512 rows (prompts of those lengths, each alone), against the CPU.
3. Failover: PP=2 with --max-restarts 1 and deterministic inference, eight streams; rank 1 SIGKILLed once every
   stream has 16 tokens; every stream must end with the tokens of an undisturbed run.

Each row says how long it took; the whole run is meant to stay under 5 minutes. `--device cpu` runs the same
rows over gloo (the script's own check on a machine without a GPU; its reference is then the CPU itself).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
import traceback
from pathlib import Path

import gpu_check  # this directory's: `python scripts/nccl_check.py` puts it on the path
import torch

PROMPTS = [[300 + i, 301, 302 + 2 * i, 303] for i in range(8)]
SEAM_ROWS = (1, 7, 8, 512)


def greedy(model: str, prompts: list[list[int]], max_tokens: int, alone: bool = False, **kw) -> list[list[int]]:
    """Each prompt's greedy tokens; `alone`: one prompt at a time (its prefill is a seam of its length)."""
    from ringsched import Engine, SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    with Engine(model=model, dtype="float32", kv_cache_memory="1G", max_model_len=1024, **kw) as llm:
        batches = [[p] for p in prompts] if alone else [prompts]
        return [r.token_ids for batch in batches for r in llm.generate(batch, params)]


def matching(ref: list[list[int]], got: list[list[int]]) -> str:
    same, total = gpu_check.matching(ref, got)  # tokens equal up to each row's first difference
    return f"{'ok' if same == total else 'MISMATCH'} {same}/{total} tokens as the CPU"


def streams(model: str, device: str, kill_after: int | None) -> list[list[int]]:
    """Eight greedy streams of 64 tokens at PP=2 with one restart allowed; with `kill_after`, rank 1 SIGKILLed
    once every stream has that many tokens. Each stream's tokens (an error fails the row)."""
    from ringsched import Engine, SamplingParams

    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    kw = {"pp_size": 2, "max_restarts": 1, "enable_deterministic_inference": True, "kv_cache_memory": "1G"}
    generations = 0 if kill_after is None else 1
    with Engine(model=model, dtype="float32", device=device, max_model_len=1024, **kw) as llm:
        rids = [llm.submit(p, params) for p in PROMPTS]
        got, done = {r: [] for r in rids}, set()
        deadline = time.monotonic() + 180
        while len(done) < len(rids):
            if time.monotonic() > deadline:
                raise RuntimeError("a stream never ended")
            for o in llm.poll(0.05):
                if o.error:
                    raise RuntimeError(f"stream {o.rid}: {o.error}")
                got[o.rid] += o.token_ids
                done |= {o.rid} if o.finish_reason else set()
            if kill_after is not None and min(len(t) for t in got.values()) >= kill_after:
                os.kill(llm.supervisor.procs[1].pid, signal.SIGKILL)
                kill_after = None
        if llm.supervisor.generation != generations:
            raise RuntimeError(f"the ring is in generation {llm.supervisor.generation}, not {generations}")
        return [got[r] for r in rids]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a model directory")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--out", type=Path, default=None, help="also write the table here")
    args = ap.parse_args()
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    if args.device == "cuda" and gpus < 2:
        os.environ["RINGSCHED_ONE_GPU"] = "1"  # the stages inherit it: every rank on cuda:0
    os.environ["RINGSCHED_TF32"] = "0"
    mode = {0: "gloo on CPU", 1: "NCCL, every rank on one GPU"}.get(gpus, f"NCCL, {gpus} GPUs")
    rows: list[tuple[str, str]] = []

    def check(name: str, fn) -> None:
        start = time.perf_counter()
        try:
            value = fn()
        except Exception as e:  # one failing row must not hide the others
            traceback.print_exc()
            value = f"FAILED: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:160]
        rows.append((name, f"{value} ({time.perf_counter() - start:.0f} s)"))
        print(f"{rows[-1][0]}: {rows[-1][1]}", flush=True)

    ref = greedy(args.model, PROMPTS, 16, device="cpu")
    for name, kw in (("PP=2", {"pp_size": 2}), ("TP=2", {"tp_size": 2})):
        check(f"greedy {name}", lambda kw=kw: matching(ref, greedy(args.model, PROMPTS, 16, device=args.device, **kw)))
    seams = [[(7 * i) % 500 + 3 for i in range(n)] for n in SEAM_ROWS]
    check(f"PP=3, seams of {', '.join(map(str, SEAM_ROWS))} rows", lambda: matching(
        greedy(args.model, seams, 4, alone=True, device="cpu"),
        greedy(args.model, seams, 4, alone=True, device=args.device, pp_size=3)))  # fmt: skip
    undisturbed: list[list[int]] = []
    check("PP=2 undisturbed streams", lambda: undisturbed.extend(streams(args.model, args.device, None)) or "ok")
    check("PP=2, rank 1 killed mid-stream", lambda: matching(undisturbed, streams(args.model, args.device, 16)))
    name = torch.cuda.get_device_name(0) if gpus else "CPU"
    gpu_check.report(f"nccl_check: {mode} ({name}), torch {torch.__version__}, model {args.model}", rows, args.out)
    return 1 if any("FAILED" in v or "MISMATCH" in v for _, v in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
