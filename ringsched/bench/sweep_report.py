"""What `bench sweep` writes: `sweep.json`, `sweep.md` and two plots, from the sweep record.

The record is `{"date", "model", "server_args", "ladder", "serve", "configs": [...]}`. Each config is
`{"label", "flags", "error", "server_log", "rungs": [...]}`, plus `log_tail` when it failed. Each rung is
`{"rate", "result", "stages"}`: `rate` the configured request rate (requests/s, or the string "inf", as
`bench serve` writes it), `result` the full `bench serve` result dict, `stages` the per-stage accounting
of `stage_metrics.py`.

Contract: `write_report(sweep, out_dir)` writes `sweep.json` (unless `json_too=False`), `sweep.md` (one table
row per rung), `tpot_vs_rate.png` (median TPOT) and `throughput_vs_rate.png` (output tokens/s), and returns
the Markdown. In the plots the x axis is the configured rate on a log scale, one line per config; the `inf`
rung is drawn one doubling right of the largest finite rate, labelled "inf" and joined by a dotted segment,
since its offered rate is not a number (its achieved rate is in the table's req/s column).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display, and no GUI toolkit needed
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import NullLocator  # noqa: E402

COLUMNS = (
    "config",
    "rate (req/s)",
    "req/s",
    "output tok/s",
    "median TTFT (ms)",
    "median TPOT (ms)",
    "p99 ITL (ms)",
    "failed",
    "stage busy",
)
PLOTS = (
    ("tpot_vs_rate.png", "median_tpot_ms", "median TPOT (ms)"),
    ("throughput_vs_rate.png", "output_throughput", "output throughput (tokens/s)"),
)


def save_json(sweep: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(sweep, indent=2) + "\n")


def load_sweep(path: str | Path) -> dict[str, Any]:
    sweep = json.loads(Path(path).read_text())
    if not isinstance(sweep, dict) or not isinstance(sweep.get("configs"), list):
        raise ValueError("not a sweep record: it has no list of configs; give the sweep.json a sweep wrote")
    return sweep


def write_report(sweep: dict[str, Any], out_dir: Path, json_too: bool = True) -> str:
    out_dir.mkdir(parents=True, exist_ok=True)
    if json_too:
        save_json(sweep, out_dir / "sweep.json")
    table = markdown_table(sweep)
    (out_dir / "sweep.md").write_text(table + "\n")
    for name, key, label in PLOTS:
        plot_vs_rate(sweep, key, label, out_dir / name)
    return table


def markdown_table(sweep: dict[str, Any]) -> str:
    """One row per rung, configs in sweep order; configs that failed are listed under the table."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "| --- |" + " ---: |" * (len(COLUMNS) - 1)]
    for cfg in sweep["configs"]:
        for rung in cfg["rungs"]:
            lines.append("| " + " | ".join(_row(cfg["label"], rung)) + " |")
    for cfg in sweep["configs"]:
        if cfg.get("error"):
            # A server that would not start says why in its last log line (a bad flag, a model not found).
            tail = [line for line in cfg.get("log_tail", []) if line.strip()]
            why = f" (server log: {tail[-1].strip()})" if tail else ""
            lines.append(f"\n{cfg['label']}: failed after {len(cfg['rungs'])} rungs: {cfg['error']}{why}")
    return "\n".join(lines)


def _row(label: str, rung: dict[str, Any]) -> list[str]:
    r = rung["result"]
    busy = " / ".join(f"{s['busy_fraction']:.2f}" for s in rung.get("stages", [])) or "-"
    return [
        label,
        _rate_text(rung["rate"]),
        f"{r['request_throughput']:.2f}",
        f"{r['output_throughput']:.1f}",
        f"{r['median_ttft_ms']:.1f}",
        f"{r['median_tpot_ms']:.1f}",
        f"{r['p99_itl_ms']:.1f}",
        str(r["failed_requests"]),
        busy,
    ]


def _rate_text(rate: float | str) -> str:
    return "inf" if _is_inf(rate) else f"{float(rate):g}"


def _is_inf(rate: float | str) -> bool:
    return rate == "inf" or rate == float("inf")


def plot_vs_rate(sweep: dict[str, Any], key: str, ylabel: str, path: Path) -> None:
    """One line per config of `result[key]` against the configured rate; see the module docstring for inf."""
    finite = sorted({float(r["rate"]) for c in sweep["configs"] for r in c["rungs"] if not _is_inf(r["rate"])})
    inf_x = 2 * finite[-1] if finite else 1.0
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for cfg in sweep["configs"]:
        finite_pts = [(float(r["rate"]), r["result"][key]) for r in cfg["rungs"] if not _is_inf(r["rate"])]
        inf_pts = [(inf_x, r["result"][key]) for r in cfg["rungs"] if _is_inf(r["rate"])]
        if not (finite_pts or inf_pts):
            continue  # a config that failed before its first rung
        xs, ys = zip(*finite_pts, strict=True) if finite_pts else ((), ())
        (line,) = ax.plot(xs, ys, marker="o", label=cfg["label"])
        if inf_pts:
            joined = finite_pts[-1:] + inf_pts
            ax.plot(*zip(*joined, strict=True), linestyle=":", color=line.get_color())
            ax.plot(*zip(*inf_pts, strict=True), linestyle="none", marker="s", color=line.get_color())
    ax.set_xscale("log", base=2)
    ax.set_xticks([*finite, inf_x], [*(f"{r:g}" for r in finite), "inf"])
    ax.xaxis.set_minor_locator(NullLocator())  # log axes add unlabelled minor ticks that read as rates
    ax.set_xlabel("request rate (requests/s)")
    ax.set_ylabel(ylabel)
    ax.set_title(f"{ylabel} vs request rate ({Path(str(sweep.get('model', ''))).name})", fontsize=10)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
