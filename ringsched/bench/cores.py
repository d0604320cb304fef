"""`python -m ringsched.bench cores`: how much compute two stages really get on this machine.

Runs the same single-threaded matmul (SmolLM2's MLP shape) in one process, then in N processes pinned to
different CPUs at once. If N at once each run much slower than one alone, the CPUs share a physical core
(SMT siblings, or a hypervisor's), and no pipeline can scale by N here: that bounds what `bench offline` can
show for "adding a stage".
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time


def _worker(cpu: int, seconds: float, start, q) -> None:
    import torch

    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, [cpu])
    torch.set_num_threads(1)
    x, w = torch.randn(128, 576), torch.randn(1536, 576)
    for _ in range(5):
        torch.nn.functional.linear(x, w)
    start.wait()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        torch.nn.functional.linear(x, w)
        n += 1
    q.put(2 * 128 * 576 * 1536 * n / (time.perf_counter() - t0) / 1e9)


def measure(cpus: list[int], seconds: float) -> list[float]:
    ctx = mp.get_context("spawn")
    q, start = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_worker, args=(c, seconds, start, q)) for c in cpus]
    for p in procs:
        p.start()
    time.sleep(2.0)  # imports done
    start.set()
    out = [q.get(timeout=120) for _ in procs]
    for p in procs:
        p.join()
    return out


def add_cores_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cpus", type=int, default=2, help="processes to run at once")
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", action="store_true")


def run_cores(args: argparse.Namespace) -> dict:
    cpus = sorted(os.sched_getaffinity(0))[: args.cpus] if hasattr(os, "sched_getaffinity") else list(range(args.cpus))
    alone, together = [], []
    for _ in range(args.repeat):
        alone.append(measure(cpus[:1], args.seconds)[0])
        together.append(sum(measure(cpus, args.seconds)))
    a, t = statistics.median(alone), statistics.median(together)
    result = {"cpus": cpus, "gflops_one_alone": a, "gflops_all_together": t, "scaling": t / a}
    print(
        f"one process alone: {a:.1f} GFLOP/s; {len(cpus)} at once: {t:.1f} GFLOP/s in total "
        f"= {t / a:.2f}x (ideal {len(cpus)}x), medians of {args.repeat}"
    )
    if args.json:
        print(json.dumps(result))
    return result
