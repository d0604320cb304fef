"""Connections are bounded and the key guards every path: the real app on real HTTP over a fake ring.

What it checks: idle connections and clients sending their headers a byte at a time are closed by the header
timeout while normal requests are served; connections past `max_connections` get a 503 in OpenAI's shape; a
body that stops arriving gets a 408; a client that leaves mid-body is no error in the log; with an API key,
`/openapi.json` and unknown paths answer 401, `bearer` in any case is accepted; echoed strings are cut; a
server on a busy port exits before it starts a stage, with one line naming the flag.
"""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from fake_ring import FrontEnd

from ringsched.server.http_limits import HttpLimits

SHORT = HttpLimits(header_timeout=1.0, body_timeout=1.0, keep_alive_timeout=1.0, max_connections=600)


@pytest.fixture(scope="module")
def front(smollm2_dir):
    fe = FrontEnd(str(smollm2_dir), http=SHORT, grammar_workers=0)
    yield fe
    fe.close()


def _connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.setblocking(False)
    return s


def _closed(s: socket.socket) -> bool:
    """The server closed `s` (whatever it sent first is read and dropped)."""
    try:
        while True:
            data = s.recv(65536)
            if not data:
                return True
    except BlockingIOError:
        return False
    except OSError:
        return True


def _read_all(s: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


def _wait_closed(socks: list[socket.socket], timeout: float) -> list[socket.socket]:
    deadline = time.monotonic() + timeout
    open_ = list(socks)
    while open_ and time.monotonic() < deadline:
        open_ = [s for s in open_ if not _closed(s)]
        time.sleep(0.05)
    return open_


def test_idle_and_slow_clients_are_closed_while_requests_are_served(front):
    idle = [_connect(front.port) for _ in range(500)]
    slow = [_connect(front.port) for _ in range(50)]
    request = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n"
    stop = threading.Event()

    def trickle() -> None:  # a byte a second for each slow client, never the whole header
        for i in range(len(request)):
            for s in slow:
                try:
                    s.send(request[i : i + 1])
                except OSError:
                    pass
            if stop.wait(0.25):
                return

    t = threading.Thread(target=trickle, daemon=True)
    t.start()
    try:
        with httpx.Client(base_url=front.url, timeout=10) as hc:
            for _ in range(3):  # served beside them
                r = hc.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
                assert r.status_code == 200, r.text
        left = _wait_closed(idle + slow, timeout=SHORT.header_timeout + 4)
        assert not left, f"{len(left)} of 550 connections still open"
    finally:
        stop.set()
        t.join()
        for s in idle + slow:
            s.close()


def test_an_idle_connection_gets_a_408_and_a_keep_alive_one_is_closed(front):
    s = socket.create_connection(("127.0.0.1", front.port), timeout=10)
    s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n")  # headers never finished
    reply = _read_all(s)
    assert reply.startswith(b"HTTP/1.1 408") and b"--http-header-timeout" in reply
    s.close()
    with httpx.Client(base_url=front.url, timeout=10) as hc:  # a kept-alive connection, idle after its response
        assert hc.get("/health").status_code == 200
        time.sleep(SHORT.keep_alive_timeout + 1)
        assert hc.get("/health").status_code == 200  # httpx reconnects: the old connection was closed


def test_connections_past_the_limit_get_a_503(smollm2_dir):
    fe = FrontEnd(str(smollm2_dir), http=HttpLimits(header_timeout=2.0, max_connections=5), grammar_workers=0)
    try:
        held = [_connect(fe.port) for _ in range(5)]
        time.sleep(0.2)
        extra = socket.create_connection(("127.0.0.1", fe.port), timeout=10)
        reply = _read_all(extra)
        assert reply.startswith(b"HTTP/1.1 503"), reply
        assert b'"code": "too_many_connections"' in reply and b"--max-connections" in reply
        extra.close()
        assert not _wait_closed(held, timeout=6)  # the header timeout frees them
        with httpx.Client(base_url=fe.url, timeout=10) as hc:
            assert hc.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
        for s in held:
            s.close()
    finally:
        fe.close()


def test_a_body_that_stops_arriving_gets_a_408(front):
    s = socket.create_connection(("127.0.0.1", front.port), timeout=10)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
              b"content-length: 100000\r\n\r\n{\"prom")  # fmt: skip
    reply = _read_all(s)
    assert reply.startswith(b"HTTP/1.1 408") and b"--http-body-timeout" in reply, reply
    s.close()
    assert front.wait_open(0) == 0


def test_a_client_that_leaves_mid_body_is_not_an_error(front, caplog):
    with caplog.at_level(logging.DEBUG, logger="ringsched.server"):
        s = socket.create_connection(("127.0.0.1", front.port), timeout=10)
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 5000\r\n\r\n{\"messages\"")
        time.sleep(0.2)
        s.close()
        deadline = time.monotonic() + 5
        while "left before its body was read" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
    assert "left before its body was read" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


def test_clients_leaving_streams_of_several_choices_log_no_error(front, caplog):
    """n=2 streams dropped by their clients mid-stream: each request is aborted on the ring (both sequences), and
    closing its merged generators logs nothing at ERROR (they used to fail with "aclose(): asynchronous generator is
    already running" when the server's cancel scope cut their cleanup short)."""
    aborted = len(front.ring.aborted)
    body = {"model": "m", "prompt": "hi", "n": 2, "max_tokens": 200, "stream": True}
    with caplog.at_level(logging.INFO):
        for _ in range(20):
            with httpx.Client(timeout=10) as c, c.stream("POST", f"{front.url}/v1/completions", json=body) as r:
                assert r.status_code == 200
                for k, _line in enumerate(r.iter_lines()):
                    if k > 6:
                        break
        assert front.wait_open(0) == 0
        assert front.wait_aborted(aborted + 40) == aborted + 40
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


@pytest.fixture(scope="module")
def keyed(smollm2_dir):
    fe = FrontEnd(str(smollm2_dir), api_key="sesame", grammar_workers=0)
    yield fe
    fe.close()


@pytest.mark.parametrize("path", ["/openapi.json", "/docs", "/v1/models", "/no/such/path", "/metrics"])
def test_every_path_but_health_needs_the_key(keyed, path):
    with httpx.Client(base_url=keyed.url, timeout=10) as hc:
        r = hc.get(path)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
        assert hc.get(path, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert hc.get(path, headers={"Authorization": "Basic sesame"}).status_code == 401
        assert hc.get("/health").status_code == 200


def test_the_bearer_scheme_is_case_insensitive(keyed):
    with httpx.Client(base_url=keyed.url, timeout=10) as hc:
        for scheme in ("Bearer", "bearer", "BEARER"):
            r = hc.get("/openapi.json", headers={"Authorization": f"{scheme} sesame"})
            assert r.status_code == 200 and r.json()["info"]["title"] == "ringsched", scheme
        assert hc.get("/v1/models", headers={"Authorization": "bearer Sesame"}).status_code == 401  # the key's case


def test_an_echoed_model_name_is_cut(front):
    with httpx.Client(base_url=front.url, timeout=10) as hc:
        r = hc.post("/v1/completions", json={"model": "m" * 500_000, "prompt": "hi"})
    assert r.status_code == 404 and len(r.text) < 1000, len(r.text)
    assert "(500002 characters)" in r.json()["error"]["message"]


def test_a_busy_port_stops_the_launcher_before_any_stage(smollm2_dir):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        run = subprocess.run([sys.executable, "-m", "ringsched.launch", "--model", str(smollm2_dir), "--port",
                              str(port), "--pp-size", "2"], capture_output=True, text=True, timeout=60)  # fmt: skip
    assert run.returncode == 1, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: cannot listen on 127.0.0.1:{port} (--port)"), lines
    assert "in use" in lines[0] and "Traceback" not in run.stderr
