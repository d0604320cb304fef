"""Model FLOPs a stage did, and how they compare with a plain matmul of the same shapes on this machine.

The yardstick: at saturation, each stage's model FLOPs per second should reach at least half of what
`torch.nn.functional.linear` reaches with the model's MLP shape, the run's tokens per micro-batch, the same
dtype and the same threads, measured beside the run. Model FLOPs count the useful work only (2 per
multiply-add of a weight, plus attention's score and value products); norms, rotary, sampling and any padding
are not counted, so they show up as lost efficiency.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ringsched.stage.affinity import restored_threads_and_cpus
from ringsched.weights.model_config import ModelConfig, layer_matmul_params


@dataclass(frozen=True)
class FlopModel:
    """FLOPs per token through one decoder layer, and per row through the lm_head."""

    per_token_per_layer: float
    lm_head_per_row: float
    mean_context: float

    @classmethod
    def of(cls, m: ModelConfig, mean_context: float) -> FlopModel:
        return cls(layer_flops_per_token(m, mean_context), lm_head_flops_per_row(m), mean_context)

    def stage_flops(self, tokens: int, layers: int, sample_rows: int) -> float:
        """A stage's model FLOPs: `tokens` through its `layers`, plus `sample_rows` through the lm_head."""
        return tokens * layers * self.per_token_per_layer + sample_rows * self.lm_head_per_row


def layer_flops_per_token(m: ModelConfig, context: float) -> float:
    """2 per weight, plus q·k and p·v over `context` positions: 2 * context * head_dim each, per query head."""
    return 2 * layer_matmul_params(m) + 4 * context * m.num_heads * m.head_dim


def lm_head_flops_per_row(m: ModelConfig) -> float:
    return 2 * m.hidden_size * m.vocab_size


def mean_context(input_len: int, output_len: int) -> float:
    """Mean attention context over the tokens a request computes.

    Those are the prompt and every generated token but the last (it is sampled, never fed back): positions
    0 .. n-1 with n = input_len + output_len - 1, and the token at position p attends to p + 1 positions, so
    the mean is (n + 1) / 2.
    """
    return (input_len + output_len) / 2


@contextmanager
def _threads_and_cpus(threads: int) -> Iterator[list[int]]:
    """Run with `threads` torch threads pinned to the first `threads` CPUs (stage 0's, when the stages were
    pinned), then restore both: the reference must see what one stage sees, not the whole machine."""
    with restored_threads_and_cpus(threads) as allowed:
        cpus = allowed[:threads]
        if cpus:
            os.sched_setaffinity(0, cpus)
        yield cpus


def matmul_gflops(
    rows: int, m: ModelConfig, dtype: torch.dtype, threads: int, device: str = "cpu", seconds: float = 2.0
) -> dict:
    """GFLOP/s of `linear(x, w)`, x [rows, hidden], w [intermediate, hidden] (the MLP's up projection).

    Timed in four windows; the best one is the reference, so a burst of someone else's work on a shared
    machine lowers the yardstick less (and the efficiency quoted against it errs low, not high).
    """
    rows = max(int(rows), 1)
    x = torch.randn(rows, m.hidden_size, dtype=dtype, device=device)
    w = torch.randn(m.intermediate_size, m.hidden_size, dtype=dtype, device=device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    flop = 2 * rows * m.hidden_size * m.intermediate_size
    with _threads_and_cpus(threads) as cpus:
        for _ in range(5):  # warm the caches and the kernel choice
            torch.nn.functional.linear(x, w)
        windows = [_calls_per_s(x, w, seconds / 4, sync) * flop / 1e9 for _ in range(4)]
    return {
        "rows": rows,
        "hidden": m.hidden_size,
        "intermediate": m.intermediate_size,
        "dtype": str(dtype),
        "threads": threads,
        "cpus": cpus,
        "device": device,
        "gflops_per_s": max(windows),
        "window_gflops_per_s": windows,
    }


def _calls_per_s(x: torch.Tensor, w: torch.Tensor, seconds: float, sync: Callable[[], None]) -> float:
    sync()
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        torch.nn.functional.linear(x, w)
        n += 1
        if n % 64 == 0:  # on a GPU, keep the queue short so the clock measures work done
            sync()
    sync()
    return n / (time.perf_counter() - start)


def stage_flops(deltas: list[dict], partition: list[int], flops: FlopModel, elapsed: float) -> list[dict]:
    """Per stage: model GFLOP/s over the run's wall time and over the stage's own compute time."""
    out = []
    for d, layers in zip(deltas, partition, strict=True):
        # With a flexible cut the layers differ per micro-batch: the stage counted tokens x layers it ran.
        total = (
            flops.stage_flops(d["layer_tokens"], 1, d["sample_rows"])
            if d.get("layer_tokens")
            else (flops.stage_flops(d["tokens"], layers, d["sample_rows"]))
        )
        out.append(
            {
                "model_gflop": total / 1e9,
                "gflops_per_s_wall": total / elapsed / 1e9,
                "gflops_per_s_compute": total / max(d["compute_s"], 1e-9) / 1e9,
            }
        )
    return out


def efficiency(flops_per_stage: list[dict], reference_gflops: float) -> list[float]:
    """Each stage's model FLOP/s over the run's wall time, as a fraction of the plain matmul's."""
    return [s["gflops_per_s_wall"] / reference_gflops for s in flops_per_stage]
