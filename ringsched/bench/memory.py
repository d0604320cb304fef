"""Each stage's peak memory against its budget: its share of the weights, plus its KV pool, plus 300 MiB.

On CPU the peak is the stage process's peak resident set, which also holds the Python interpreter and the
torch libraries (a couple of hundred MiB before any weight is loaded): that is part of the honest figure, so
it counts against the overhead. On a GPU it is torch's peak allocation on the stage's device.
"""

from __future__ import annotations

OVERHEAD_BUDGET_BYTES = 300 * 2**20


def stage_memory(stats: dict, info: dict, budget: int = OVERHEAD_BUDGET_BYTES) -> dict:
    """One stage's peak, weights, KV pool and the rest (bytes), from its last stats and its ready info."""
    on_device = bool(stats.get("peak_device_bytes"))
    peak = int(stats["peak_device_bytes"] if on_device else stats["peak_rss_bytes"])
    weights, kv = int(info["weights_bytes"]), int(info["kv_bytes"])
    overhead = peak - weights - kv
    return {
        "source": "device" if on_device else "rss",
        "peak_bytes": peak,
        "weights_bytes": weights,
        "kv_bytes": kv,
        "overhead_bytes": overhead,
        "budget_overhead_bytes": budget,
        "within_budget": overhead <= budget,
    }


def format_memory(m: dict) -> str:
    mib = 2**20
    over = "" if m["within_budget"] else f" (over the {m['budget_overhead_bytes'] / mib:.0f} MiB budget)"
    return (
        f"peak {m['peak_bytes'] / mib:.0f} MiB = weights {m['weights_bytes'] / mib:.0f} + "
        f"KV {m['kv_bytes'] / mib:.0f} + {m['overhead_bytes'] / mib:.0f} overhead{over}"
    )
