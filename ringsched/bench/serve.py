"""`python -m ringsched.bench serve`: an async load generator for any OpenAI-compatible server.

It streams `POST {base_url}/v1/completions` requests at a chosen arrival rate (gamma inter-arrival times,
Poisson at burstiness 1), optionally capped at `--max-concurrency` in flight, measures TTFT, inter-token
gaps, TPOT and end-to-end latency per request, and prints the block `vllm bench serve` prints.

Contract: `add_serve_args(parser)` adds the flags (`serve_config.py`, with `ServeConfig`); `run_serve(args)` runs
one benchmark, prints the block, writes `--save-result` if given and returns the result dict (metric keys from
`metrics.py` plus the config). A failed request (HTTP error, exception, error chunk) is counted in
`failed_requests`, never raised.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

try:
    import aiohttp
    from tqdm import tqdm
except ImportError as e:  # the benchmark's dependencies are an optional extra
    raise ImportError(f"`ringsched.bench serve` needs aiohttp and tqdm ({e}); pip install 'ringsched[bench]'") from e

from ringsched.bench.datasets import (
    SampleRequest,
    copy_requests,
    jsonl_requests,
    random_requests,
    shared_prefix_requests,
)
from ringsched.bench.metrics import RequestResult, compute_metrics, format_metrics
from ringsched.bench.serve_config import REQUEST_TIMEOUT_S, ServeConfig
from ringsched.bench.serve_config import add_serve_args as add_serve_args  # `python -m ringsched.bench` finds it here
from ringsched.bench.stage_metrics import speculation, speculation_between

logger = logging.getLogger(__name__)


def load_requests(cfg: ServeConfig) -> list[SampleRequest]:
    if cfg.dataset == "jsonl":
        assert cfg.dataset_path is not None  # checked in ServeConfig
        return jsonl_requests(cfg.dataset_path, cfg.num_prompts)
    if cfg.dataset == "copy":
        return copy_requests(cfg.num_prompts, cfg.random_input_len, cfg.random_output_len, cfg.seed)
    requests = random_requests(
        cfg.num_prompts,
        cfg.random_input_len,
        cfg.random_output_len,
        cfg.random_range_ratio,
        cfg.random_vocab_size,
        cfg.seed,
    )
    if cfg.dataset == "shared-prefix":
        requests = shared_prefix_requests(
            requests, cfg.shared_prefix_len, cfg.shared_prefix_groups, cfg.random_vocab_size, cfg.seed
        )
    return requests


def arrival_times(n: int, request_rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """Send times in seconds from the start: the first at 0, then gamma(shape=burstiness) gaps of mean
    1/request_rate. A rate of inf sends everything at 0."""
    if request_rate == float("inf"):
        return np.zeros(n)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=max(n - 1, 0))
    return np.concatenate([[0.0], np.cumsum(gaps)])


def build_payload(model: str, req: SampleRequest, ignore_eos: bool) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "model": model,
        "prompt": req.prompt,
        "max_tokens": req.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    # An extra body field, as vLLM's benchmark sends it; left out when unset so strict servers accept us.
    if ignore_eos:
        payload["ignore_eos"] = True
    return payload


async def first_model(session: aiohttp.ClientSession, base_url: str) -> str:
    """The first model id the server lists; the error tells the user to pass --model instead."""
    url = f"{base_url.rstrip('/')}/v1/models"
    try:
        async with session.get(url) as resp:
            resp.raise_for_status()
            return (await resp.json())["data"][0]["id"]
    except (aiohttp.ClientError, KeyError, IndexError, ValueError) as e:
        raise RuntimeError(
            f"could not read a model id from GET {url} ({e}); is the server up? Check --base-url or pass --model"
        ) from e


async def send_request(
    session: aiohttp.ClientSession, url: str, payload: dict[str, Any], prompt_len: int | None
) -> RequestResult:
    """Stream one completion and time it. Never raises (except on cancellation): failures are returned."""
    result = RequestResult(prompt_len=prompt_len or 0)
    start = time.perf_counter()
    try:
        async with session.post(url, json=payload) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return result
            await _read_stream(resp, result, start, prompt_len_known=prompt_len is not None)
    except Exception as e:  # any transport or parsing failure is one failed request, not a crash
        result.error = f"{type(e).__name__}: {e}"
    return result


async def _read_stream(
    resp: aiohttp.ClientResponse, result: RequestResult, start: float, prompt_len_known: bool
) -> None:
    """Parse the SSE stream into `result`: timings per content chunk, token counts from the usage chunk."""
    last = start
    chunks_with_text = 0
    usage_tokens: int | None = None
    async for raw in resp.content:  # aiohttp yields the body line by line
        line = raw.decode("utf-8").strip()
        if not line.startswith("data:"):
            continue  # blank separators and SSE comments (keep-alives)
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        if chunk.get("error") or chunk.get("object") == "error":
            result.error = f"error chunk: {str(chunk.get('error') or chunk.get('message') or chunk)[:200]}"
            return
        choices = chunk.get("choices") or []
        if choices and choices[0].get("text"):
            result.text += choices[0]["text"]
            now = time.perf_counter()
            if chunks_with_text == 0:
                result.ttft = now - start
            else:
                result.itl.append(now - last)
            last = now
            chunks_with_text += 1
        if usage := chunk.get("usage"):
            usage_tokens = usage.get("completion_tokens", usage_tokens)
            if not prompt_len_known and usage.get("prompt_tokens") is not None:
                result.prompt_len = usage["prompt_tokens"]
            result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    result.latency = time.perf_counter() - start
    if chunks_with_text == 0:
        result.ttft = result.latency  # nothing streamed early: the first token came with the end
    # Servers may pack several tokens in a chunk, so the usage count is the truth when there is one.
    result.output_tokens = usage_tokens if usage_tokens is not None else chunks_with_text
    result.success = True


async def benchmark(cfg: ServeConfig, requests: list[SampleRequest]) -> tuple[str, list[RequestResult], float]:
    """Send `requests` on the configured schedule; returns (model, per-request results, duration in s)."""
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    # limit=0: aiohttp's default pool of 100 connections would silently cap concurrency; the only cap we
    # want is --max-concurrency. force_close: a connection per request, as each request is its own client; on a
    # reused keep-alive connection llama.cpp's server dropped ~20% of 64 concurrent requests ("Can not write
    # request body").
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=headers) as session:
        model = cfg.model or await first_model(session, cfg.base_url)
        rng = np.random.default_rng(cfg.seed)
        offsets = arrival_times(len(requests), cfg.request_rate, cfg.burstiness, rng)
        limit = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else contextlib.nullcontext()
        pbar = tqdm(total=len(requests), disable=cfg.disable_tqdm)
        start = time.perf_counter()

        async def one(req: SampleRequest, offset: float) -> RequestResult:
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            async with limit:  # an arrival waits here while max_concurrency requests are in flight
                result = await send_request(
                    session, cfg.completions_url, build_payload(model, req, cfg.ignore_eos), req.prompt_len
                )
            pbar.update(1)
            return result

        results = await asyncio.gather(*(one(r, float(o)) for r, o in zip(requests, offsets, strict=True)))
        duration = time.perf_counter() - start
        pbar.close()
    return model, list(results), duration


def run_serve(args: argparse.Namespace) -> dict[str, Any]:
    """Run one benchmark from parsed `serve` flags; print the summary block and return the result dict."""
    cfg = ServeConfig.from_args(args)
    requests = load_requests(cfg)
    spec_before = speculation(cfg.base_url)
    model, results, duration = asyncio.run(benchmark(cfg, requests))
    metrics = compute_metrics(results, duration)
    spec = speculation_between(spec_before, speculation(cfg.base_url))  # a ringsched server's, while drafting
    print(format_metrics(metrics, cfg.max_concurrency, cfg.request_rate))
    if spec:
        print(f"{'Draft acceptance rate:':<40} {spec['spec_acceptance_rate']:<10.3f}")
        print(f"{'Mean accepted length:':<40} {spec['spec_mean_accepted_length']:<10.2f}")
    errors = [r.error for r in results if not r.success]
    if errors:
        logger.warning("%d of %d requests failed; first error: %s", len(errors), len(results), errors[0])
    config = dataclasses.asdict(cfg)
    config.pop("api_key")  # a secret does not belong in a result file
    # JSON has no infinity; vLLM writes the string "inf" too.
    config["request_rate"] = cfg.request_rate if cfg.request_rate != float("inf") else "inf"
    result = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        **config,
        "model": model,
        **metrics.as_dict(),
        **spec,
        "errors": errors,
    }
    if cfg.save_result:
        path = Path(cfg.save_result)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
    return result
