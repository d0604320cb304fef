"""Per-stage accounting read from a running server's `/metrics`, for `bench sweep`.

Contract: `parse_stage_metrics(text)` reads the Prometheus text into `{stage: {"compute_s", "wait_s",
"sched_s", "comm_s", "peak_memory_bytes"}}` (the `ringsched:stage_time_seconds` gauges are cumulative
seconds since the stage started, idle time left out); `stage_deltas(before, after, duration)` turns two such
snapshots into what each stage spent in between, with `busy_fraction` = compute seconds / `duration`.
`speculation(base_url)` reads the speculative decoding counters (None from a server without them), and
`speculation_between(before, after)` what a benchmark's requests drafted and kept.
"""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable
from typing import TypeVar

from prometheus_client.parser import text_string_to_metric_families

T = TypeVar("T")
TIME_KINDS = ("compute", "wait", "sched", "comm")
TIME_METRIC = "ringsched:stage_time_seconds"
MEMORY_METRIC = "ringsched:stage_peak_memory_bytes"
SPEC_METRICS = {
    "ringsched:spec_decode_num_drafts": "steps",
    "ringsched:spec_decode_num_draft_tokens": "drafts",
    "ringsched:spec_decode_num_accepted_tokens": "kept",
}


def scrape_stages(base_url: str, timeout: float = 10.0) -> dict[int, dict[str, float]]:
    """GET `{base_url}/metrics` and parse the per-stage gauges."""
    with urllib.request.urlopen(f"{base_url.rstrip('/')}/metrics", timeout=timeout) as resp:
        return parse_stage_metrics(resp.read().decode("utf-8"))


def speculation(base_url: str, timeout: float = 10.0) -> dict[str, float] | None:
    """The speculative decoding counters of a ringsched server (`steps`, `drafts`, `kept`); None where the server
    has no `/metrics` or no such counters (another engine)."""
    try:
        with urllib.request.urlopen(f"{base_url.rstrip('/')}/metrics", timeout=timeout) as resp:
            text = resp.read().decode("utf-8")
    except OSError:
        return None
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            name = s.name.removesuffix("_total")
            if name in SPEC_METRICS:
                out[SPEC_METRICS[name]] = s.value
    return out if len(out) == len(SPEC_METRICS) else None


def speculation_between(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float]:
    """`spec_acceptance_rate` (kept / drafted) and `spec_mean_accepted_length` (1 + kept per verifying step) of
    what happened between two `speculation` readings; empty when nothing was drafted or the server lacks them."""
    if before is None or after is None:
        return {}
    steps, drafts, kept = (after[k] - before[k] for k in ("steps", "drafts", "kept"))
    if steps <= 0 or drafts <= 0:
        return {}
    return {"spec_acceptance_rate": kept / drafts, "spec_mean_accepted_length": 1 + kept / steps}


def parse_stage_metrics(text: str) -> dict[int, dict[str, float]]:
    stages: dict[int, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == TIME_METRIC and s.labels.get("kind") in TIME_KINDS:
                stages.setdefault(int(s.labels["stage"]), {})[f"{s.labels['kind']}_s"] = s.value
            elif s.name == MEMORY_METRIC:
                stages.setdefault(int(s.labels["stage"]), {})["peak_memory_bytes"] = s.value
    return stages


def stage_deltas(
    before: dict[int, dict[str, float]], after: dict[int, dict[str, float]], duration: float
) -> list[dict[str, float | int]]:
    """One dict per stage (in stage order): seconds of each kind spent between the snapshots, the busy
    fraction over `duration`, and the peak memory so far. A stage missing from `before` starts at zero."""
    rows: list[dict[str, float | int]] = []
    for rank in sorted(after):
        start, end = before.get(rank, {}), after[rank]
        row: dict[str, float | int] = {"stage": rank}
        for kind in TIME_KINDS:
            key = f"{kind}_s"
            row[key] = max(end.get(key, 0.0) - start.get(key, 0.0), 0.0)
        row["busy_fraction"] = row["compute_s"] / duration if duration > 0 else 0.0
        row["peak_memory_bytes"] = int(end.get("peak_memory_bytes", 0))
        rows.append(row)
    return rows


def settled(
    read: Callable[[], T], moved: Callable[[T, T], bool], interval_s: float = 0.7, deadline_s: float = 10.0
) -> T:
    """Stage stats once they have stopped moving. Stages report every 0.5 s, idle or not, so two reads
    `interval_s` apart that agree include the last micro-batch; one fixed wait could miss it on a loaded host
    (CI saw a busy fraction of 1.26 when the next measurement counted it). The last read after `deadline_s`."""
    deadline = time.monotonic() + deadline_s
    time.sleep(interval_s)
    last = read()
    while time.monotonic() < deadline:
        time.sleep(interval_s)
        now = read()
        if not moved(last, now):
            return now
        last = now
    return last
