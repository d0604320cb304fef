"""Time a decode step's GGUF linear layers by path: the kernel's integer dot products (int8 activations), its float
tiles (`RINGSCHED_GGUF_INTEGER=0`), and the weights dequantized for MKL, by type and rows.

The weights are a whole model's projections in random blocks of the type (distinct tensors per layer, so they
stream from memory as in a real step): SmolLM2-135M's shapes with q/k/v and gate/up fused, plus the tied lm_head
(for the K-quants, whose 256-value blocks must divide a row, its down projections alone).
Each path is timed in turns with the others, medians of `--rounds`; the last column is the weights' bytes over
the best path's time.

    python scripts/bench_gguf_linear.py --types Q4_0,Q8_0,Q4_K,Q6_K --rows 1,16,64 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F

from ringsched.kernels import gguf_linear

SMOLLM2 = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]
SCALES = {2: [0], 3: [0, 2], 6: [0], 7: [0, 2], 8: [0], 12: [0, 2], 13: [0, 2], 14: [208]}  # fp16 fields a block


def random_weight(qtype: int, n: int, k: int, rng: np.random.Generator) -> torch.Tensor:
    """`n` rows of random blocks, their float16 scales small and finite."""
    _, values, nbytes = gguf_linear.TYPES[qtype]
    raw = rng.integers(0, 256, size=(n, k // values, nbytes), dtype=np.uint8)
    for at in SCALES[qtype]:
        raw[:, :, at : at + 2] = (
            rng.uniform(1e-3, 1e-2, size=(n, k // values)).astype(np.float16)[..., None].view(np.uint8)
        )
    return torch.from_numpy(raw.reshape(n, -1))


def step(path: str, x: dict[int, torch.Tensor], layers: list[tuple[torch.Tensor, int, int]], qtype: int) -> None:
    lib = gguf_linear.library()
    lib.gguf_set_integer(int(path == "integer"))
    for raw, _, k in layers:
        if path == "dequant+MKL":
            F.linear(x[k], gguf_linear.dequantize(raw, qtype, k))
        else:
            gguf_linear.gguf_matmul(x[k], raw, qtype, None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", default="Q4_0,Q8_0,Q4_K,Q6_K")
    ap.add_argument("--rows", default="1,16,64")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    names = {v[0]: t for t, v in gguf_linear.TYPES.items()}
    rng = np.random.default_rng(0)
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    print(f"{cpu}, {args.threads} threads, integer path: {gguf_linear.library().gguf_has_integer()}")
    print("| type | rows | integer (ms) | float tiles (ms) | dequant+MKL (ms) | GB/s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name in args.types.split(","):
        qtype = names[name]
        block = gguf_linear.TYPES[qtype][1]  # a K-quant's 256 values divide only the down projection's 1536
        layers = [(random_weight(qtype, n, k, rng), n, k) for n, k in SMOLLM2 if k % block == 0]
        size = sum(raw.numel() for raw, _, _ in layers)
        for rows in (int(r) for r in args.rows.split(",")):
            x = {k: torch.randn(rows, k) for k in {k for _, _, k in layers}}
            paths = ["integer", "float", "dequant+MKL"]
            times: dict[str, list[float]] = {p: [] for p in paths}
            for p in paths:
                step(p, x, layers, qtype)  # warm
            for r in range(args.rounds):
                for p in paths[r % 3 :] + paths[: r % 3]:
                    t0 = time.perf_counter()
                    step(p, x, layers, qtype)
                    times[p].append(time.perf_counter() - t0)
            med = {p: statistics.median(v) * 1e3 for p, v in times.items()}
            best = min(med.values())
            print(f"| {name} | {rows} | {med['integer']:.2f} | {med['float']:.2f} | {med['dequant+MKL']:.2f} | "
                  f"{size / best / 1e6:.1f} |", flush=True)  # fmt: skip
    gguf_linear.library().gguf_set_integer(1)


if __name__ == "__main__":
    main()
