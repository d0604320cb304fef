"""Prometheus metrics (prefix `ringsched:`, after vLLM's and SGLang's names) and the throughput log line.

Contract: `ServerMetrics()` owns its `CollectorRegistry` (two servers in one process never collide);
`request_finished(...)` records one request's latencies, tokens and finish reason; `render(client)` refreshes
the gauges from the engine client's latest stage reports and returns the exposition text. `log_throughput`
logs one line every few seconds while the server is busy.
"""

from __future__ import annotations

import asyncio
import logging
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ringsched.server.engine_client import EngineClient

logger = logging.getLogger("ringsched.server")

# Latency buckets in seconds; CPU stages are slow, so the buckets reach further than vLLM's.
_TTFT = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_TPOT = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
_E2E = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        # Defined in groups, in this order (the exposition lists them so).
        for define in (self._define_requests, self._define_stages, self._define_ranks, self._define_totals,
                       self._define_speculation, self._define_recovery):  # fmt: skip
            define(self.registry, "ringsched:")

    def _define_requests(self, r: CollectorRegistry, p: str) -> None:
        """Latency histograms and the request gauges."""
        self.ttft = Histogram(f"{p}time_to_first_token_seconds", "Time to first token.", buckets=_TTFT, registry=r)
        self.tpot = Histogram(
            f"{p}time_per_output_token_seconds", "Mean time per output token after the first, per request.",
            buckets=_TPOT, registry=r,
        )  # fmt: skip
        self.e2e = Histogram(f"{p}e2e_request_latency_seconds", "End-to-end latency.", buckets=_E2E, registry=r)
        self.running = Gauge(f"{p}num_requests_running", "Requests stage 0 is running.", registry=r)
        self.open = Gauge(
            f"{p}num_requests_open", "Requests the server accepted and has not yet ended (running or waiting).",
            registry=r,
        )  # fmt: skip
        self.waiting = Gauge(f"{p}num_requests_waiting", "Requests waiting for admission.", registry=r)

    def _define_stages(self, r: CollectorRegistry, p: str) -> None:
        """Per-stage gauges, from the stages' reports."""
        self.kv_usage = Gauge(f"{p}kv_cache_usage_perc", "KV pool usage (0-1) per stage.", ["stage"], registry=r)
        self.busy = Gauge(
            f"{p}stage_busy_fraction", "Share of the last window a stage computed.", ["stage"], registry=r
        )
        self.bubble = Gauge(
            f"{p}stage_bubble_fraction", "Share of the last window a stage waited on a neighbour.", ["stage"],
            registry=r,
        )  # fmt: skip
        self.stage_time = Gauge(
            f"{p}stage_time_seconds", "Seconds a stage spent, by kind: compute, wait (for a neighbour: the "
            "bubble), sched (planning/applying plans), comm (posting sends); idle time is left out.",
            ["stage", "kind"], registry=r,
        )  # fmt: skip
        self.peak_memory = Gauge(
            f"{p}stage_peak_memory_bytes", "Peak resident memory of a stage process (device memory on GPU).",
            ["stage"], registry=r,
        )  # fmt: skip
        self.stage_tokens = Gauge(
            f"{p}stage_tokens", "Tokens a stage computed since start (prompt chunks and decodes; cached prompt "
            "tokens are not computed).", ["stage"], registry=r,
        )  # fmt: skip

    def _define_ranks(self, r: CollectorRegistry, p: str) -> None:
        """Per-rank gauges (each tensor-parallel rank of a stage)."""
        rank = ["rank", "stage", "tp"]
        self.rank_peak_memory = Gauge(
            f"{p}rank_peak_memory_bytes", "Peak resident memory of each rank (device memory on GPU).", rank,
            registry=r,
        )  # fmt: skip
        self.seam_bytes = Gauge(
            f"{p}seam_bytes_per_token", "Bytes a rank sent across its stage's seam per token: 2 x hidden x dtype "
            "bytes / tp (each tensor-parallel rank sends its shard).", rank, registry=r,
        )  # fmt: skip
        self.tp_reduces = Gauge(
            f"{p}tp_all_reduces_per_batch", "Tensor-parallel all-reduces a rank ran per micro-batch (two per layer, "
            "one more for the embedding).", rank, registry=r,
        )  # fmt: skip
        self.tp_reduce_bytes = Gauge(
            f"{p}tp_all_reduce_bytes_per_token", "Bytes a rank all-reduced per token over its stage's ranks.", rank,
            registry=r,
        )  # fmt: skip

    def _define_totals(self, r: CollectorRegistry, p: str) -> None:
        """Counters since start: tokens, the prefix cache, finish reasons."""
        self.prompt_tokens = Counter(f"{p}prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter(f"{p}generation_tokens", "Generated tokens.", registry=r)
        self.cached_prompt_tokens = Counter(
            f"{p}prompt_tokens_cached", "Prompt tokens of finished requests whose KV came from the prefix cache.",
            registry=r,
        )  # fmt: skip
        # Stage 0 reports running totals; the counters follow them (`render`).
        self._prefix_seen = (0, 0)
        self.prefix_queries = Counter(
            f"{p}prefix_cache_queries", "Prompt tokens stage 0 looked up in the prefix cache (each admission).",
            registry=r,
        )  # fmt: skip
        self.prefix_hits = Counter(
            f"{p}prefix_cache_hits", "Of the looked-up prompt tokens, those found cached (not computed).", registry=r
        )
        self.prefix_hit_rate = Gauge(
            f"{p}prefix_cache_hit_rate", "prefix_cache_hits / prefix_cache_queries since start (0-1).", registry=r
        )
        self.cached_idle_blocks = Gauge(
            f"{p}kv_cache_idle_cached_blocks", "Stage 0's KV blocks no request holds that keep a cached prefix "
            "(free capacity, evicted least recently used).", registry=r,
        )  # fmt: skip
        self.finished = Counter(
            f"{p}request_success", "Finished requests by finish reason (stop, length, abort, error).",
            ["finished_reason"], registry=r,
        )  # fmt: skip

    def _define_speculation(self, r: CollectorRegistry, p: str) -> None:
        """--speculative-config: drafts verified and kept (vLLM's spec_decode names), from stage 0's running totals."""
        self._spec_seen = {"spec_verify_steps": 0, "spec_draft_tokens": 0, "spec_accepted_tokens": 0}
        self.spec_counters = {
            "spec_verify_steps": Counter(
                f"{p}spec_decode_num_drafts", "Decode steps that verified drafts.", registry=r
            ),  # fmt: skip
            "spec_draft_tokens": Counter(f"{p}spec_decode_num_draft_tokens", "Draft tokens verified.", registry=r),
            "spec_accepted_tokens": Counter(f"{p}spec_decode_num_accepted_tokens", "Draft tokens kept.", registry=r),
        }
        self.spec_rate = Gauge(f"{p}spec_decode_acceptance_rate", "Kept draft tokens / verified draft tokens since "
                               "start (0-1).", registry=r)  # fmt: skip
        self.spec_length = Gauge(f"{p}spec_decode_mean_accepted_length", "Tokens a verifying step gave per request "
                                 "on average since start: 1 + kept drafts per step.", registry=r)  # fmt: skip

    def _render_speculation(self, sched: dict) -> None:
        for key, counter in self.spec_counters.items():
            now = sched.get(key, 0)
            counter.inc(_since(now, self._spec_seen[key]))
            self._spec_seen[key] = now
        drafts, kept, steps = (sched.get(k, 0) for k in ("spec_draft_tokens", "spec_accepted_tokens",
                                                          "spec_verify_steps"))  # fmt: skip
        self.spec_rate.set(kept / drafts if drafts else 0.0)
        self.spec_length.set(1 + kept / steps if steps else 0.0)

    def _define_recovery(self, r: CollectorRegistry, p: str) -> None:
        """Failed ranks replaced (`--max-restarts`) and the requests replayed into the ring after each."""
        self.rank_restarts = Counter(f"{p}rank_restarts", "Times each rank was replaced after dying, failing or "
                                     "hanging.", ["rank"], registry=r)  # fmt: skip
        self.replayed = Counter(f"{p}requests_replayed", "Open requests replayed into a ring whose failed rank was "
                                "replaced.", registry=r)  # fmt: skip
        self.recovery_pause = Histogram(
            f"{p}recovery_pause_seconds", "Seconds from a failed rank seen to every rank ready again, per recovery.",
            buckets=_E2E, registry=r,
        )  # fmt: skip
        self.request_pause = Histogram(
            f"{p}request_replay_pause_seconds", "Seconds a replayed request went without a token, per request.",
            buckets=_E2E, registry=r,
        )  # fmt: skip
        # restarts per rank, replayed, recovery pauses, request pauses
        self._recovery_seen: tuple[dict[int, int], int, int, int] = ({}, 0, 0, 0)

    def _render_recovery(self, client: EngineClient) -> None:
        recovery = client.supervisor.recovery
        restarts, replayed, pauses, request_pauses = self._recovery_seen
        for rank, n in recovery.replaced.items():
            self.rank_restarts.labels(rank=str(rank)).inc(n - restarts.get(rank, 0))
        self.replayed.inc(client.requests_replayed - replayed)
        for pause in recovery.pauses[pauses:]:
            self.recovery_pause.observe(pause)
        waits = client.open_requests.pauses
        for pause in waits[request_pauses:]:
            self.request_pause.observe(pause)
        self._recovery_seen = (dict(recovery.replaced), client.requests_replayed, len(recovery.pauses), len(waits))

    def request_finished(
        self,
        reason: str,
        prompt_tokens: int,
        completion_tokens: int,
        arrival: float,
        first_token: float | None,
        end: float,
        cached_tokens: int = 0,
    ) -> None:
        self.finished.labels(finished_reason=reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.cached_prompt_tokens.inc(cached_tokens)
        self.generation_tokens.inc(completion_tokens)
        self.e2e.observe(end - arrival)
        if first_token is not None:
            self.ttft.observe(first_token - arrival)
            if completion_tokens > 1:
                self.tpot.observe((end - first_token) / (completion_tokens - 1))

    def render(self, client: EngineClient) -> bytes:
        sched = client.sched_stats
        self.running.set(sched.get("running", 0))
        self.open.set(client.num_open)
        self.waiting.set(client.num_waiting())
        queries, hits = sched.get("prefix_cache_queries", 0), sched.get("prefix_cache_hits", 0)
        seen_queries, seen_hits = self._prefix_seen
        self.prefix_queries.inc(max(queries - seen_queries, 0))
        self.prefix_hits.inc(max(hits - seen_hits, 0))
        self._prefix_seen = (max(queries, seen_queries), max(hits, seen_hits))
        self.prefix_hit_rate.set(hits / queries if queries else 0.0)
        self.cached_idle_blocks.set(sched.get("kv_cached_idle_blocks", 0))
        stats = client.stage_stats()
        kv_usage: dict[str, float] = {}  # a stage's fullest pool (its CP ranks each hold their own tokens)
        for rank, s in stats.items():
            stage = str(s.get("stage", rank))
            kv_usage[stage] = max(kv_usage.get(stage, 0.0), s.get("kv_usage", 0.0))
        for rank, s in stats.items():
            peak = s.get("peak_device_bytes") or s.get("peak_rss_bytes", 0)
            where = {"rank": str(rank), "stage": str(s.get("stage", rank)), "tp": str(s.get("tp", 0))}
            self.rank_peak_memory.labels(**where).set(peak)
            self.seam_bytes.labels(**where).set(s.get("seam_bytes_sent", 0) / max(s.get("seam_tokens_sent", 0), 1))
            self.tp_reduces.labels(**where).set(s.get("tp_all_reduces", 0) / max(s.get("batches", 0), 1))
            self.tp_reduce_bytes.labels(**where).set(s.get("tp_all_reduce_bytes", 0) / max(s.get("tokens", 0), 1))
            if s.get("tp", 0) or s.get("cp", 0):
                continue  # a stage's figures: its first rank's (its ranks share the plan and the pace)
            stage = where["stage"]
            self.kv_usage.labels(stage=stage).set(kv_usage.get(stage, 0.0))
            self.busy.labels(stage=stage).set(s.get("busy_fraction", 0.0))
            self.bubble.labels(stage=stage).set(s.get("bubble_fraction", 0.0))
            self.stage_tokens.labels(stage=stage).set(s.get("tokens", 0))
            for kind in ("compute", "wait", "sched", "comm"):
                self.stage_time.labels(stage=stage, kind=kind).set(s.get(f"{kind}_s", 0.0))
            self.peak_memory.labels(stage=stage).set(peak)
        self._render_speculation(sched)
        self._render_recovery(client)
        return generate_latest(self.registry)


async def log_throughput(client: EngineClient, period: float = 5.0) -> None:
    """Every `period` seconds while busy: running, waiting, prompt and generation tokens/s, KV usage. Prompt
    tokens/s is what stage 0 planned for prefill in the period (a long prompt counts as it is computed, chunk by
    chunk); generation tokens/s what reached the front end."""
    last = time.monotonic()
    prefill, gen = client.sched_stats.get("prefill_tokens", 0), client.counters.generation_tokens
    while True:
        await asyncio.sleep(period)
        now = time.monotonic()
        dt = now - last
        prefill_now, gen_now = client.sched_stats.get("prefill_tokens", 0), client.counters.generation_tokens
        running, waiting = client.sched_stats.get("running", 0), client.num_waiting()
        if gen_now > gen or prefill_now > prefill or running or waiting:
            stages = [s for _, s in sorted(client.stage_stats().items()) if not (s.get("tp", 0) or s.get("cp", 0))]
            kv = ", ".join(f"{s.get('kv_usage', 0.0):.1%}" for s in stages)
            logger.info(
                "running %d, waiting %d, prompt %.1f tok/s, generation %.1f tok/s, KV usage per stage %s",
                running, waiting, _since(prefill_now, prefill) / dt, (gen_now - gen) / dt, kv or "-",
            )  # fmt: skip
        last, prefill, gen = now, prefill_now, gen_now


def _since(now: int, before: int) -> int:
    """A counter's growth over a period; stage 0's counts start again from 0 when a recovery replaces its planner."""
    return now - before if now >= before else now
