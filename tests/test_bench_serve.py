"""`ringsched.bench serve` against a fake OpenAI-style server, plus the metrics math on hand-made inputs."""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shlex
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("tqdm")
from aiohttp import web  # noqa: E402

from ringsched.bench.datasets import (  # noqa: E402
    copy_requests,
    jsonl_requests,
    length_range,
    random_requests,
    shared_prefix_requests,
)
from ringsched.bench.metrics import RequestResult, compute_metrics, format_metrics  # noqa: E402
from ringsched.bench.serve import ServeConfig, add_serve_args, arrival_times, run_serve  # noqa: E402


class FakeCompletionsServer:
    """Test double for the benchmark client's unit tests only; it is not a model server.

    Serves `/v1/models` and a streaming `/v1/completions` in the OpenAI SSE format: `max_tokens /
    tokens_per_chunk` text chunks `chunk_delay` apart, then a usage chunk (unless `send_usage` is off) and
    `data: [DONE]`. The n-th request (1-based) gets HTTP 500 when `fail_every` divides n, and an error chunk
    mid-stream when `error_chunk_every` divides n. It records bodies, headers, arrival times and the most
    streams open at once.
    """

    def __init__(self) -> None:
        self.chunk_delay = 0.002
        self.tokens_per_chunk = 1
        self.send_usage = True
        self.cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, when set
        self.fail_every = 0
        self.error_chunk_every = 0
        self.bodies: list[dict] = []
        self.auth: list[str | None] = []
        self.arrivals: list[float] = []
        self.active = 0
        self.max_active = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        return app

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.auth.append(request.headers.get("Authorization"))
        self.arrivals.append(time.perf_counter())
        n = len(self.bodies)
        if self.fail_every and n % self.fail_every == 0:
            return web.Response(status=500, text="injected failure")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            error = bool(self.error_chunk_every and n % self.error_chunk_every == 0)
            await self._stream(resp, body, error)
        finally:
            self.active -= 1
        return resp

    def _details(self, prompt_tokens: int) -> dict:
        if self.cached_tokens is None:
            return {}
        return {"prompt_tokens_details": {"cached_tokens": min(self.cached_tokens, prompt_tokens)}}

    async def _stream(self, resp: web.StreamResponse, body: dict, error: bool) -> None:
        async def send(obj: dict | str) -> None:
            await resp.write(f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode())

        n_chunks = body["max_tokens"] // self.tokens_per_chunk
        for i in range(n_chunks):
            await asyncio.sleep(self.chunk_delay)
            if error and i == 1:
                await send({"error": {"message": "injected error chunk", "code": 500}})
                return
            finish = "length" if i == n_chunks - 1 else None
            await send(
                {
                    "object": "text_completion",
                    "model": body["model"],
                    "choices": [{"index": 0, "text": f" t{i}", "finish_reason": finish}],
                }
            )
        if self.send_usage and body.get("stream_options", {}).get("include_usage"):
            prompt = body["prompt"]
            prompt_tokens = len(prompt) if isinstance(prompt, list) else len(prompt.split())
            await send(
                {
                    "choices": [],
                    "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": body["max_tokens"],
                              **self._details(prompt_tokens)},  # fmt: skip
                }
            )
        await send("[DONE]")


@pytest.fixture
def fake_server() -> Iterator[tuple[FakeCompletionsServer, str]]:
    server = FakeCompletionsServer()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    runner = web.AppRunner(server.app())
    asyncio.run_coroutine_threadsafe(runner.setup(), loop).result()
    site = web.TCPSite(runner, "127.0.0.1", 0)  # port 0: a free port, so parallel test runs never collide
    asyncio.run_coroutine_threadsafe(site.start(), loop).result()
    port = runner.addresses[0][1]
    try:
        yield server, f"http://127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=5)
        loop.close()


def run(cmdline: str) -> dict:
    """`run_serve` on a `serve` command line, parsed by the real `add_serve_args` parser."""
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    return run_serve(parser.parse_args(["--disable-tqdm", *shlex.split(cmdline)]))


def test_counts_tokens_payload_and_saved_json(fake_server, tmp_path, capsys):
    server, url = fake_server
    out = tmp_path / "result.json"
    result = run(
        f"--base-url {url} --num-prompts 8 --random-input-len 16 --random-output-len 5 "
        f"--random-vocab-size 2000 --ignore-eos --api-key sekret --save-result {out}"
    )
    assert result["model"] == "fake-model"  # from /v1/models
    assert (result["successful_requests"], result["failed_requests"]) == (8, 0)
    assert result["total_input_tokens"] == 8 * 16 and result["total_output_tokens"] == 8 * 5
    assert result["mean_ttft_ms"] > 0 and result["mean_tpot_ms"] > 0 and result["mean_itl_ms"] > 0
    assert result["p99_e2el_ms"] >= result["median_e2el_ms"] > result["median_ttft_ms"]

    body = server.bodies[0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["temperature"] == 0 and body["max_tokens"] == 5 and body["ignore_eos"] is True
    assert all(1000 <= t < 2000 for b in server.bodies for t in b["prompt"])
    assert set(server.auth) == {"Bearer sekret"}

    saved = json.loads(out.read_text())
    assert saved == json.loads(json.dumps(result)) and "api_key" not in saved
    counts = "successful_requests failed_requests duration total_input_tokens total_output_tokens"
    throughputs = "request_throughput output_throughput total_token_throughput"
    latencies = [f"{p}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for p in ("mean", "median", "p99")]
    assert set(counts.split() + throughputs.split() + latencies) <= set(saved)
    assert saved["request_rate"] == "inf" and saved["num_prompts"] == 8 and saved["seed"] == 0
    assert "============ Serving Benchmark Result ============" in capsys.readouterr().out


def test_failures_are_counted_not_raised(fake_server):
    server, url = fake_server
    server.fail_every, server.error_chunk_every = 4, 5  # requests 4, 8 get HTTP 500; 5, 10 an error chunk
    result = run(
        f"--base-url {url} --num-prompts 10 --max-concurrency 1 --random-input-len 4 --random-output-len 3"
    )
    assert (result["successful_requests"], result["failed_requests"]) == (6, 4)
    assert result["total_output_tokens"] == 6 * 3
    assert sum("HTTP 500" in e for e in result["errors"]) == 2
    assert sum("error chunk" in e for e in result["errors"]) == 2


def test_jsonl_usage_preferred_then_chunk_count(fake_server, tmp_path):
    server, url = fake_server
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "one two three", "output_len": 6}\n\n{"prompt": "four", "output_len": 4}\n')
    server.tokens_per_chunk = 2  # the usage chunk, not the chunk count, gives the output tokens
    cmdline = f"--base-url {url} --model m --dataset jsonl --dataset-path {path} --num-prompts 3"
    result = run(cmdline)
    assert result["total_output_tokens"] == 6 + 4 + 6
    assert result["total_input_tokens"] == 3 + 1 + 3  # from usage.prompt_tokens: no tokenizer here
    assert [b["model"] for b in server.bodies] == ["m"] * 3

    server.send_usage = False
    result = run(cmdline)
    assert result["total_output_tokens"] == 3 + 2 + 3  # falls back to chunks with text


def test_request_rate_pacing(fake_server):
    server, url = fake_server
    # A high gamma shape makes the gaps nearly regular: 20 gaps of 1/40 s.
    run(
        f"--base-url {url} --num-prompts 21 --request-rate 40 --burstiness 50 "
        "--random-input-len 4 --random-output-len 2"
    )
    span = max(server.arrivals) - min(server.arrivals)
    assert 0.4 < span < 0.8, span


def test_max_concurrency_is_respected(fake_server):
    server, url = fake_server
    server.chunk_delay = 0.005
    common = f"--base-url {url} --num-prompts 12 --random-input-len 4 --random-output-len 6"
    result = run(f"{common} --max-concurrency 3")
    assert server.max_active == 3 and result["successful_requests"] == 12
    server.max_active = 0
    run(common)
    assert server.max_active >= 8  # uncapped, all start at once (no hidden connection-pool cap)


def test_unreachable_server_names_the_fix():
    with pytest.raises(RuntimeError, match="--model"):
        run("--base-url http://127.0.0.1:1 --num-prompts 1")


def test_metrics_math_on_hand_made_results():
    results = [
        RequestResult(success=True, prompt_len=10, output_tokens=11, ttft=0.1, itl=[0.1] * 10, latency=1.1),
        RequestResult(success=True, prompt_len=20, output_tokens=5, ttft=0.2, itl=[0.2] * 4, latency=1.0),
        RequestResult(success=True, prompt_len=30, output_tokens=1, ttft=0.3, latency=0.3),  # no TPOT
        RequestResult(success=True, prompt_len=40, output_tokens=3, ttft=0.4, itl=[0.3, 0.3], latency=1.0),
        RequestResult(success=False, error="HTTP 500"),
    ]
    m = compute_metrics(results, duration=2.0).as_dict()
    assert (m["successful_requests"], m["failed_requests"]) == (4, 1)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (100, 20)
    assert m["request_throughput"] == 2.0 and m["output_throughput"] == 10.0
    assert m["total_token_throughput"] == 60.0
    assert m["mean_ttft_ms"] == pytest.approx(250.0) and m["median_ttft_ms"] == pytest.approx(250.0)
    assert m["p99_ttft_ms"] == pytest.approx(397.0)  # linear interpolation, as numpy and vLLM do
    # TPOT per request: (1.1-0.1)/10 = 0.1, (1.0-0.2)/4 = 0.2, (1.0-0.4)/2 = 0.3; the 1-token one is skipped.
    assert m["mean_tpot_ms"] == pytest.approx(200.0) and m["median_tpot_ms"] == pytest.approx(200.0)
    assert m["mean_itl_ms"] == pytest.approx(1000 * (1.0 + 0.8 + 0.6) / 16)
    assert m["median_e2el_ms"] == pytest.approx(1000.0)

    empty = compute_metrics([RequestResult(error="x")], duration=1.0).as_dict()
    assert empty["mean_ttft_ms"] == 0.0 and empty["p99_itl_ms"] == 0.0 and empty["failed_requests"] == 1


def test_printed_block_matches_vllm_layout():
    m = compute_metrics(
        [RequestResult(success=True, prompt_len=4, output_tokens=3, ttft=0.1, itl=[0.05, 0.05], latency=0.2)],
        duration=0.5,
    )
    lines = format_metrics(m, max_concurrency=4, request_rate=2.0).splitlines()
    assert lines[0] == "============ Serving Benchmark Result ============"
    assert lines[1] == f"{'Successful requests:':<40} {1:<10}"
    assert lines[2].startswith("Failed requests:") and "Maximum request concurrency:" in lines[3]
    labels = [line.split(":")[0] for line in lines]
    for label in (
        "Benchmark duration (s)",
        "Total input tokens",
        "Total generated tokens",
        "Request throughput (req/s)",
        "Output token throughput (tok/s)",
        "Total Token throughput (tok/s)",
        "Mean TTFT (ms)",
        "Median TPOT (ms)",
        "P99 ITL (ms)",
        "P99 E2EL (ms)",
    ):
        assert label in labels
    assert "-----Time per Output Token (excl. 1st token)------" in lines
    assert "----------------End-to-end Latency----------------" in lines
    assert lines[-1] == "=" * 50 and all(len(line) <= 51 for line in lines if "-" * 5 in line)


def test_arrival_times_follow_rate_and_burstiness():
    rng = np.random.default_rng(0)
    assert arrival_times(5, float("inf"), 1.0, rng).tolist() == [0.0] * 5
    for burstiness in (1.0, 4.0):
        t = arrival_times(20001, 10.0, burstiness, rng)
        gaps = np.diff(t)
        assert t[0] == 0.0 and gaps.mean() == pytest.approx(0.1, rel=0.03)
        # A gamma of shape k has coefficient of variation 1/sqrt(k): 1 for Poisson, 0.5 at k=4.
        assert gaps.std() / gaps.mean() == pytest.approx(1 / np.sqrt(burstiness), rel=0.05)


def test_random_dataset_lengths_and_determinism():
    assert length_range(10, 0.5) == (5, 15) and length_range(1, 0.9) == (1, 2)
    reqs = random_requests(200, 10, 20, range_ratio=0.5, vocab_size=512, seed=3)
    assert {len(r.prompt) for r in reqs} <= set(range(5, 16)) and len({len(r.prompt) for r in reqs}) > 5
    assert all(10 <= r.output_len <= 30 and r.prompt_len == len(r.prompt) for r in reqs)
    assert all(256 <= t < 512 for r in reqs for t in r.prompt)  # small vocab: offset shrinks to vocab/2
    assert reqs == random_requests(200, 10, 20, range_ratio=0.5, vocab_size=512, seed=3)
    with pytest.raises(ValueError, match="--random-range-ratio"):
        random_requests(1, 10, 10, range_ratio=1.0)


def test_shared_prefix_dataset_and_the_cached_share(fake_server, capsys):
    reqs = shared_prefix_requests(random_requests(6, 4, 3, vocab_size=512, seed=1), 12, 2, vocab_size=512, seed=1)
    assert [len(r.prompt) for r in reqs] == [16] * 6 and all(r.prompt_len == 16 for r in reqs)
    heads = [tuple(r.prompt[:12]) for r in reqs]
    assert heads[0] == heads[2] == heads[4] != heads[1] == heads[3] == heads[5]
    assert len({tuple(r.prompt[12:]) for r in reqs}) == 6  # each its own tail
    assert reqs == shared_prefix_requests(random_requests(6, 4, 3, vocab_size=512, seed=1), 12, 2, vocab_size=512,
                                          seed=1)  # fmt: skip
    with pytest.raises(ValueError, match="--shared-prefix-len"):
        shared_prefix_requests(random_requests(1, 4, 3), 0, 1)

    server, url = fake_server
    server.cached_tokens = 8
    result = run(f"--base-url {url} --dataset shared-prefix --shared-prefix-len 12 --shared-prefix-groups 2 "
                 "--random-input-len 4 --random-output-len 3 --num-prompts 6")  # fmt: skip
    assert result["total_input_tokens"] == 6 * 16 and result["total_cached_tokens"] == 6 * 8
    assert [b["prompt"] for b in server.bodies] != [] and len({tuple(b["prompt"][:12]) for b in server.bodies}) == 2
    assert re.search(r"Prefix cache hit rate \(%\):\s+50\.00", capsys.readouterr().out)


def test_jsonl_dataset_errors_name_the_line(tmp_path: Path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok", "output_len": 2}\n{"prompt": "no length"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: \"output_len\""):
        jsonl_requests(path, 2)
    with pytest.raises(FileNotFoundError, match="--dataset-path"):
        jsonl_requests(tmp_path / "missing.jsonl", 1)
    with pytest.raises(ValueError, match="--dataset-path"):
        ServeConfig(dataset="jsonl")
    with pytest.raises(ValueError, match="--request-rate"):
        ServeConfig(request_rate=0.0)


def test_the_copy_dataset_asks_to_repeat_or_lightly_edit_a_passage_of_the_asked_length():
    reqs = copy_requests(6, 400, 300, seed=3)
    assert reqs == copy_requests(6, 400, 300, seed=3) and reqs != copy_requests(6, 400, 300, seed=4)
    for i, r in enumerate(reqs):
        passage = r.prompt.split("\n\n")[1]
        assert len(passage.split()) == 300 and r.output_len == 300 and r.prompt_len is None
        assert ("but write" in r.prompt) == bool(i % 2)  # every other request edits one word
    assert len({r.prompt.split("\n\n")[1] for r in reqs}) == 6
    with pytest.raises(ValueError, match="--random-input-len"):
        copy_requests(2, 4, 10)
