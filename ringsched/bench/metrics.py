"""Serving benchmark results: per-request measurements in, the `vllm bench serve` summary out.

Contract: `compute_metrics(results, duration)` is pure; its `as_dict()` keys are the printed names
snake-cased (`successful_requests`, `mean_ttft_ms`, `p99_e2el_ms`, ...), and `format_metrics` prints the
same block, line for line, that `vllm bench serve` prints, so numbers from both tools can be set side by side.
Latencies are measured in seconds and reported in milliseconds.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

# (key in the dict, name in the printed block, section header), in vLLM's order.
LATENCY_METRICS = (
    ("ttft", "TTFT", "Time to First Token"),
    ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl", "ITL", "Inter-token Latency"),
    ("e2el", "E2EL", "End-to-end Latency"),
)
PERCENTILES = ("mean", "median", "p99")
WIDTH = 50


@dataclass
class RequestResult:
    """What one request measured. Times are seconds from the moment the request was sent."""

    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the server took from its prefix cache (usage.prompt_tokens_details)
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    error: str = ""
    text: str = ""  # the completion's text, streamed (left out of the metrics; scripts compare it)

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; undefined for a single-token answer."""
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


@dataclass(frozen=True)
class LatencyStats:
    """Mean, median and p99 of one latency, in milliseconds (all 0 when there were no samples)."""

    mean: float
    median: float
    p99: float

    @classmethod
    def of(cls, seconds: list[float]) -> LatencyStats:
        if not seconds:
            return cls(0.0, 0.0, 0.0)
        ms = np.asarray(seconds, dtype=np.float64) * 1000.0
        return cls(float(ms.mean()), float(np.median(ms)), float(np.percentile(ms, 99)))


@dataclass(frozen=True)
class BenchmarkMetrics:
    successful_requests: int
    failed_requests: int
    duration: float
    total_input_tokens: int
    total_output_tokens: int
    total_cached_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    ttft: LatencyStats
    tpot: LatencyStats
    itl: LatencyStats
    e2el: LatencyStats

    def as_dict(self) -> dict[str, float | int]:
        """Flat dict: counts and throughputs, then `{mean,median,p99}_{ttft,tpot,itl,e2el}_ms`."""
        out: dict[str, float | int] = {k: v for k, v in asdict(self).items() if not isinstance(v, dict)}
        for key, _, _ in LATENCY_METRICS:
            stats = asdict(getattr(self, key))
            for p in PERCENTILES:
                out[f"{p}_{key}_ms"] = stats[p]
        return out


def compute_metrics(results: list[RequestResult], duration: float) -> BenchmarkMetrics:
    """Aggregate per-request results over a benchmark that took `duration` seconds (wall clock).

    Only successful requests count towards tokens and latencies; throughputs divide by the whole duration,
    so failures lower them, as they lower what a user of the server gets.
    """
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    per_s = 1.0 / duration if duration > 0 else 0.0
    return BenchmarkMetrics(
        successful_requests=len(ok),
        failed_requests=len(results) - len(ok),
        duration=duration,
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        total_cached_tokens=sum(r.cached_tokens for r in ok),
        request_throughput=len(ok) * per_s,
        output_throughput=total_out * per_s,
        total_token_throughput=(total_in + total_out) * per_s,
        ttft=LatencyStats.of([r.ttft for r in ok]),
        tpot=LatencyStats.of([t for r in ok if (t := r.tpot) is not None]),
        itl=LatencyStats.of([gap for r in ok for gap in r.itl]),
        e2el=LatencyStats.of([r.latency for r in ok]),
    )


def format_metrics(m: BenchmarkMetrics, max_concurrency: int | None = None, request_rate: float = float("inf")) -> str:
    """The summary block, formatted exactly as `vllm bench serve` formats it."""
    lines = [
        "{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=WIDTH, c="="),
        _row("Successful requests:", m.successful_requests),
        _row("Failed requests:", m.failed_requests),
    ]
    if max_concurrency is not None:
        lines.append(_row("Maximum request concurrency:", max_concurrency))
    if request_rate != float("inf"):
        lines.append(_row("Request rate configured (RPS):", request_rate))
    lines += [
        _row("Benchmark duration (s):", m.duration),
        _row("Total input tokens:", m.total_input_tokens),
        _row("Total generated tokens:", m.total_output_tokens),
        _row("Prefix cache hit rate (%):", 100.0 * m.total_cached_tokens / max(m.total_input_tokens, 1)),
        _row("Request throughput (req/s):", m.request_throughput),
        _row("Output token throughput (tok/s):", m.output_throughput),
        _row("Total Token throughput (tok/s):", m.total_token_throughput),
    ]
    for key, name, header in LATENCY_METRICS:
        stats: LatencyStats = getattr(m, key)
        lines.append("{s:{c}^{n}}".format(s=header, n=WIDTH, c="-"))
        lines.append(_row(f"Mean {name} (ms):", stats.mean))
        lines.append(_row(f"Median {name} (ms):", stats.median))
        lines.append(_row(f"P99 {name} (ms):", stats.p99))
    lines.append("=" * WIDTH)
    return "\n".join(lines)


def _row(label: str, value: float | int) -> str:
    # Integers print as counts, floats with two decimals, both in vLLM's 40-column layout.
    if isinstance(value, int):
        return f"{label:<40} {value:<10}"
    return f"{label:<40} {value:<10.2f}"
