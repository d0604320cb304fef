"""Time a decode step's linear layers, torch's path against the native small-batch kernel, by rows and dtype.

The weights are a whole model's projections (distinct tensors per layer, so they stream from memory as in a
real step, not from cache): by default SmolLM2-135M's shapes with q/k/v and gate/up fused, plus the tied lm_head.
Each configuration is timed in turns with the others, medians of `--rounds`. This is what the fixed thresholds
(`MAX_ROWS` in `ringsched/kernels/small_linear.py`, `--linear-tuning off`) were chosen from; by default each stage
makes the same comparison at start-up on its own weights (`ringsched/kernels/linear_tuning.py`).

    python scripts/bench_small_linear.py --threads 2 --rows 1,2,4,8,16,32
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from ringsched.kernels import small_linear
from ringsched.kernels.quantize import quantize_int8_weight
from ringsched.models.llama import cpu_layout

SMOLLM2 = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]


def weights(dtype: str) -> list[dict]:
    out = []
    for i, (n, k) in enumerate(SMOLLM2):
        w = torch.randn(n, k) / k**0.5
        head = i == len(SMOLLM2) - 1
        if dtype == "float32":
            out.append({"w": w if head else cpu_layout("model.layers.0.x_proj.weight", w)})
        elif dtype == "bfloat16":
            out.append({"w": w.bfloat16()})
        else:
            q, s = quantize_int8_weight(w)
            out.append({"w": q, "s": s})
    return out


def step(ws: list[dict], xs: dict[int, torch.Tensor], path: str) -> None:
    for layer in ws:
        w, x = layer["w"], xs[layer["w"].shape[1]]
        if path == "kernel":
            small_linear.native_linear(x, w, None, layer.get("s"))
        elif w.dtype == torch.int8:
            torch._weight_int8pack_mm(x, w, layer["s"])
        else:
            F.linear(x, w)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--rows", default="1,2,4,8,16,32")
    ap.add_argument("--dtypes", default="float32,bfloat16,int8")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    assert small_linear.library() is not None, "the native kernel did not build"
    params = sum(n * k for n, k in SMOLLM2)
    print(f"{params / 1e6:.1f}M weights, {args.threads} threads; ms per step (GB/s of weights)")
    print("| dtype | rows | torch | kernel | kernel / torch |\n| --- | --- | --- | --- | --- |")
    for dtype in args.dtypes.split(","):
        ws = weights(dtype)
        elt = {"float32": 4, "bfloat16": 2, "int8": 1}[dtype]
        xdtype = torch.bfloat16 if dtype == "bfloat16" else torch.float32
        for m in (int(r) for r in args.rows.split(",")):
            xs = {k: torch.randn(m, k, dtype=xdtype) for k in (576, 1536)}
            times: dict[str, list[float]] = {"torch": [], "kernel": []}
            step(ws, xs, "torch")
            step(ws, xs, "kernel")
            for _ in range(args.rounds):
                for path in times:
                    t = time.perf_counter()
                    step(ws, xs, path)
                    times[path].append((time.perf_counter() - t) * 1e3)
            med = {p: statistics.median(v) for p, v in times.items()}
            gbs = {p: params * elt / med[p] / 1e6 for p in med}
            print(f"| {dtype} | {m} | {med['torch']:.2f} ({gbs['torch']:.0f}) | {med['kernel']:.2f} "
                  f"({gbs['kernel']:.0f}) | {med['kernel'] / med['torch']:.2f} |")  # fmt: skip
        del ws


if __name__ == "__main__":
    main()
