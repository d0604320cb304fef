"""The HTTP front end over a fake ring (tests/fake_ring.py): real HTTP, the real app, EngineClient and ZMQ, no model.

What it checks: every malformed request of the fuzz table gets its status and `param`; a burst is admitted
exactly up to running + queued; a failure injected at each step of a request's path ends that request and
releases it; streams that wait get keep-alive comments; errors carry string codes.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from fake_ring import FrontEnd
from fuzz_cases import CASES, Case

from ringsched.server import serving
from ringsched.server.endpoints import _Stream


@pytest.fixture(scope="module")
def front(smollm2_dir):
    fe = FrontEnd(str(smollm2_dir), max_running=16, max_queued=50)
    yield fe
    fe.close()


@pytest.fixture(autouse=True)
def _ring_runs(front):
    front.ring.mode, front.ring.first_delay_s = "run", 0.0
    yield
    assert front.wait_open(0) == 0, "a request was not released"


def _assert_openai_error(r: httpx.Response, status: int, param: str | None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    assert err["param"] == param, err
    assert err["code"] is None or isinstance(err["code"], str), err
    return err


def test_fuzz_table_is_large_and_covers_every_endpoint():
    assert len(CASES) >= 150
    assert {c.path for c in CASES} == {"/v1/completions", "/v1/chat/completions", "/generate"}


def test_fuzz_cases_get_their_status_and_param(front):
    with httpx.Client(base_url=front.url, timeout=30) as hc:
        for case in CASES:
            r = hc.post(case.path, content=case.payload(front.ctx.max_request_bytes),
                        headers={"content-type": "application/json"})  # fmt: skip
            assert r.status_code != 500, (str(case), r.text)
            _assert_openai_error(r, case.status, case.param)
        assert hc.get("/health").status_code == 200
        r = hc.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert front.ring.aborted == []  # no refused request ever reached the ring


def test_burst_is_admitted_exactly_up_to_running_plus_queued(front):
    front.ring.mode = "hold"  # nothing finishes until every request has been answered or admitted
    received_before = len(front.ring.received)

    async def burst() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=400)
        async with httpx.AsyncClient(base_url=front.url, timeout=60, limits=limits) as hc:
            tasks = [
                asyncio.create_task(hc.post("/v1/completions", json={"prompt": f"burst {i}", "max_tokens": 2}))
                for i in range(300)
            ]
            while len(front.ring.received) - received_before < 66 or sum(t.done() for t in tasks) < 234:
                await asyncio.sleep(0.05)
            assert front.num_open == 66
            front.ring.mode = "run"
            return await asyncio.gather(*tasks)

    responses = asyncio.run(burst())
    refused = [r for r in responses if r.status_code == 503]
    assert len(refused) == 234
    for r in refused:
        assert r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "queue_full"
    done = [r for r in responses if r.status_code == 200]
    assert len(done) == 66 and all(r.json()["usage"]["completion_tokens"] == 2 for r in done)


# -- a failure at each step of a request's path ---------------------------------------------------------------
def _inject(front: FrontEnd, monkeypatch, step: str) -> None:
    ctx = front.ctx

    def boom(*args, **kwargs):
        raise RuntimeError(f"injected at {step}")

    if step == "tokenize":
        monkeypatch.setattr(ctx.tokenizer, "encode", boom)
    elif step == "send":
        monkeypatch.setattr(ctx.client.link.inp, "send", boom)
    elif step == "ring":
        front.ring.mode = "fail"
    elif step == "detokenize":
        monkeypatch.setattr(serving.TextStream, "add", boom)
    elif step == "metrics":
        monkeypatch.setattr(ctx.metrics, "request_finished", boom)


STEPS = ["tokenize", "send", "ring", "detokenize", "metrics"]


@pytest.mark.parametrize("step", STEPS)
def test_a_failure_at_any_step_ends_only_that_request(front, monkeypatch, step):
    aborted_before = len(front.ring.aborted)
    _inject(front, monkeypatch, step)
    body = {"prompt": "one two three", "max_tokens": 50}
    with httpx.Client(base_url=front.url, timeout=30) as hc:
        r = hc.post("/v1/completions", json=body)
        assert r.status_code == 500, r.text
        err = r.json()["error"]
        assert err["type"] == "internal_server_error" and isinstance(err["code"], (str, type(None)))
        if step == "ring":
            assert err["code"] == "request_failed"
        with hc.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
            lines = [line for line in s.iter_lines() if line.startswith("data: ")]
    if step != "tokenize":  # a stream is a 200 whose last event before [DONE] is the error
        assert lines[-1] == "data: [DONE]"
        event = json.loads(lines[-2][6:])
        assert event["error"]["type"] == "internal_server_error" and isinstance(event["error"]["code"], str)
    assert front.wait_open(0) == 0
    if step == "detokenize":  # failed while it ran on the ring: aborted there
        assert front.wait_aborted(aborted_before + 1) > aborted_before
    monkeypatch.undo()
    front.ring.mode = "run"
    r = httpx.post(f"{front.url}/v1/completions", json={"prompt": "after", "max_tokens": 3}, timeout=30)
    assert r.status_code == 200  # the server goes on


def test_client_leaving_mid_stream_releases_and_aborts(front):
    aborted_before = len(front.ring.aborted)
    front.ring.step_s = 0.05
    try:
        with httpx.Client(base_url=front.url, timeout=30) as hc:
            body = {"prompt": "long", "max_tokens": 500, "stream": True}
            with hc.stream("POST", "/v1/completions", json=body) as s:
                for line in s.iter_lines():
                    if line.startswith("data: {"):
                        break  # leaving closes the connection
        assert front.wait_open(0) == 0
        assert front.wait_aborted(aborted_before + 1) == aborted_before + 1
    finally:
        front.ring.step_s = 0.01


def test_a_stream_that_never_starts_is_released():
    released = []

    async def events():
        yield {"never": "sent"}

    async def main():
        async def receive():
            return {"type": "http.disconnect"}

        async def send(message):
            raise OSError("the client is gone")

        with pytest.raises(OSError):
            await _Stream(events(), lambda: released.append(True))({"type": "http"}, receive, send)

    asyncio.run(main())
    assert released == [True]


def test_waiting_streams_get_keepalive_comments(front, monkeypatch):
    monkeypatch.setattr(serving, "SSE_KEEPALIVE_S", 0.1)
    front.ring.first_delay_s = 0.6
    with httpx.Client(base_url=front.url, timeout=30) as hc:
        with hc.stream("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 3, "stream": True}) as s:
            lines = [line for line in s.iter_lines() if line]
    first_data = next(i for i, line in enumerate(lines) if line.startswith("data: "))
    assert first_data >= 3 and all(line == ": keep-alive" for line in lines[:first_data])
    assert lines[-1] == "data: [DONE]"
    # The openai client reads past the comments.
    client = openai.OpenAI(base_url=f"{front.url}/v1", api_key="x", max_retries=0)
    chunks = list(client.completions.create(model="m", prompt="x", max_tokens=3, stream=True))
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"


def test_engine_failure_ends_streams_with_a_string_code(smollm2_dir):
    fe = FrontEnd(str(smollm2_dir))  # its own: a failed engine stays failed
    fe.ring.mode = "hold"

    async def main() -> tuple[list[str], int, str]:
        async with httpx.AsyncClient(base_url=fe.url, timeout=30) as hc:

            async def one() -> list[str]:
                async with hc.stream("POST", "/v1/completions", json={"prompt": "x", "stream": True}) as s:
                    return [line async for line in s.aiter_lines() if line.startswith("data: ")]

            task = asyncio.create_task(one())
            while fe.num_open == 0:
                await asyncio.sleep(0.02)
            fe.supervisor.failure = "stage 1 (pid 1) is hung: no heartbeat for 10.0s"
            lines = await task
            health = await hc.get("/health")
            refused = await hc.post("/v1/completions", json={"prompt": "x"})
            return lines, health.status_code, refused.json()["error"]["code"]

    try:
        lines, health, refused_code = asyncio.run(main())
        assert fe.wait_open(0) == 0
    finally:
        fe.close()
    event = json.loads(lines[-2][6:])["error"]
    assert event["code"] == "engine_failed" and "stage 1" in event["message"] and "hung" in event["message"]
    assert lines[-1] == "data: [DONE]"
    assert health == 503 and refused_code == "engine_failed"


def test_case_payloads_are_what_they_say():
    oversize = next(c for c in CASES if c.status == 413)
    assert len(oversize.payload(1000)) > 1000
    raw = Case("/v1/completions", b"{}", 400, None)
    assert raw.payload(10) == b"{}"
