"""Render a plan: the text report a person reads, and the JSON a script reads.

Contract: `text_report(...)` returns the whole report as one string; `json_rows(rows)` returns the list of
plain dicts `--json` prints, one per (TP, PP), with bytes in bytes and sizes in GiB.
"""

from __future__ import annotations

import dataclasses
from itertools import groupby

from ringsched.capacity.cluster import ClusterSpec
from ringsched.capacity.derivation import Derivation
from ringsched.capacity.estimate import LayoutRow, bubble_fraction
from ringsched.capacity.presets import ModelSpec
from ringsched.capacity.recommend import Recommendation

KIB, MIB = 2**10, 2**20
BUBBLE_M = (1, 4, 16, 64)


def json_rows(rows: list[LayoutRow]) -> list[dict]:
    """One dict per row; floats rounded so the output diffs cleanly."""
    return [_rounded(dataclasses.asdict(row)) for row in rows]


def _rounded(value: object) -> object:
    if isinstance(value, float):
        return round(value, 6)
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return value


def text_report(
    model: ModelSpec,
    cluster: ClusterSpec,
    deriv: Derivation,
    rows: list[LayoutRow],
    skipped: list[tuple[int, int, int, str]],
    baseline: LayoutRow | None,
    rec: Recommendation,
) -> str:
    lines = _header(model, cluster, deriv)
    lines.append("")
    lines += _table(rows, baseline, cluster)
    for tp, pp, cp, why in skipped:
        name = f"TP={tp} x PP={pp}" + (f" x CP={cp}" if cp > 1 else "") if tp else f"CP={cp}"
        lines.append(f"  skipped {name}: {why}")
    stage_counts = sorted({r.pp for r in rows if r.pp > 1})
    if stage_counts:
        lines.append("")
        per_s = [", ".join(f"M={m} {bubble_fraction(s, m):.1%}" for m in BUBBLE_M) for s in stage_counts]
        lines.append("bubble (S-1)/(S+M-1) for M micro-batches in flight:")
        lines += [f"  S={s}: {text}" for s, text in zip(stage_counts, per_s, strict=True)]
    lines.append("")
    lines.append(f"recommendation: {rec.reason}")
    return "\n".join(lines)


def _header(model: ModelSpec, cluster: ClusterSpec, d: Derivation) -> list[str]:
    gpu = cluster.gpu
    t = cluster.batch_tokens
    return [
        f"model {model.name}: {model.num_layers} layers, d={model.hidden_size}, {model.num_heads} heads / "
        f"{model.num_kv_heads} KV heads x {model.head_dim}, {model.dtype_bytes} bytes per parameter: "
        f"{d.weights_gib:.2f} GiB of weights",
        f"cluster: {cluster.gpus} x {gpu.name} ({gpu.memory_gib:.2f} GiB, {gpu.hbm_tb_per_s:g} TB/s HBM, "
        f"{gpu.intra_node_gb_per_s:g} GB/s per direction in a node), {cluster.gpus_per_node} per node, "
        f"{cluster.inter_node_gbps:g} Gb/s ({cluster.inter_node_gb_per_s:g} GB/s) per GPU between nodes",
        f"per GPU: {gpu.memory_gib:.2f} x {cluster.mem_fraction:g} = {cluster.usable_gib:.2f} GiB usable, "
        f"{cluster.reserve_gib:g} GiB reserved, the rest after weights is KV; T={t} tokens per step, "
        f"max model len {cluster.max_model_len}",
        f"KV: {d.kv_bytes_per_token_per_layer / KIB:g} KiB per token per layer, "
        f"{d.kv_bytes_per_token / KIB:g} KiB for all {model.num_layers} layers (before any split)",
        f"seam (hidden_states + residual): {d.seam_bytes_per_token / KIB:g} KiB per token, "
        f"{d.seam_bytes_per_token_per_rank / KIB:g} KiB per rank sharded over TP={d.tp}",
        f"TP={d.tp} all-reduce of [{t}, {model.hidden_size}]: {d.allreduce_bytes / 1e6:.2f} MB per rank; "
        f"{d.collectives_per_step} per step = {d.tp_bytes_per_rank_per_step / 1e6:.1f} MB per rank: "
        f"{d.tp_ms_intra_node:.2f} ms in a node, {d.tp_ms_inter_node:.2f} ms over the inter-node link",
        f"TP={d.tp} per token: {d.tp_bytes_per_token_per_rank / MIB:.3f} MiB per rank, "
        f"{d.tp_to_seam_ratio:.0f}x the seam",
    ]


_COLUMNS = (
    ("TP", 3),
    ("PP", 3),
    ("weights GiB", 11),
    ("KV/tok KiB", 10),
    ("KV GiB", 7),
    ("tokens", 10),
    ("seqs", 6),
    ("vs 1 node", 9),
    ("comm KiB/tok", 12),
    ("comm MB/step", 12),
    ("comm ms", 8),
    ("TP link", 10),
    ("ideal ms", 8),
    ("uneven", 6),
    ("bubble", 6),
    ("partition", 0),
)


def _table(rows: list[LayoutRow], baseline: LayoutRow | None, cluster: ClusterSpec) -> list[str]:
    with_cp = any(r.cp > 1 for r in rows)
    columns = _COLUMNS[:2] + (("CP", 3),) + _COLUMNS[2:] if with_cp else _COLUMNS
    head = "  ".join(f"{name:>{width}}" if width else name for name, width in columns)
    lines = [
        f"per GPU of the binding stage; comm = bytes the busiest rank sends; bubble at M = --in-flight "
        f"({cluster.in_flight if cluster.in_flight is not None else 'PP'})",
    ]
    if with_cp:
        lines.append(
            "CP: tokens = a stage's CP ranks together (each stores 1/CP of every sequence); comm adds the "
            "partial outputs' all-gather per layer"
        )
    lines.append(head)
    for row in rows:
        lines.append(_line(row, with_cp))
    if baseline is not None:
        lines.append(_line(baseline, with_cp) + f"   <- baseline: TP={baseline.tp} alone on one node")
    for row in rows:
        if row.cp > 1:
            lines.append(
                f"  TP={row.tp} x PP={row.pp} x CP={row.cp}: ring attention sends "
                f"{row.cp_prefill_bytes_per_token / KIB:.1f} KiB per prompt token per rank in prefill, "
                f"over {row.cp_link}"
            )
    return lines


def _line(r: LayoutRow, with_cp: bool = False) -> str:
    vs = f"{r.concurrency_vs_one_node:+.0%}" if r.concurrency_vs_one_node is not None else "-"
    cells = (
        r.tp,
        r.pp,
        f"{r.weights_per_gpu_gib:.2f}",
        f"{r.kv_bytes_per_token_per_gpu / KIB:g}",
        f"{r.kv_space_per_gpu_gib:.2f}",
        r.token_capacity,
        r.concurrent_sequences,
        vs,
        f"{r.comm_bytes_per_rank_per_token / KIB:.1f}",
        f"{r.comm_bytes_per_rank_per_step / 1e6:.1f}",
        f"{r.comm_ms_per_step:.2f}",
        r.tp_link or "-",
        f"{r.ideal_token_latency_ms:.2f}",
        f"{r.uneven_loss:.1%}",
        f"{r.bubble:.1%}",
        _compact(r.partition),
    )
    columns = _COLUMNS
    if with_cp:
        cells, columns = cells[:2] + (r.cp,) + cells[2:], _COLUMNS[:2] + (("CP", 3),) + _COLUMNS[2:]
    line = "  ".join(f"{c:>{w}}" if w else str(c) for c, (_, w) in zip(cells, columns, strict=True))
    return line if r.fits else line + "   <- does not fit"


def _compact(counts: list[int]) -> str:
    """The split as a list up to 8 stages; longer ones run-length coded: [5]*16 -> '5x16'."""
    if len(counts) <= 8:
        return ",".join(str(c) for c in counts)
    parts = []
    for value, run in groupby(counts):
        n = len(list(run))
        parts.append(f"{value}x{n}" if n > 1 else str(value))
    return ",".join(parts)
