"""While the stages load, the HTTP port answers 503 at once (`server/loading.py`): /health says `loading`, the other
paths give the OpenAI error JSON, and the listening socket is the HTTP server's afterwards."""

from __future__ import annotations

import socket
import time

import httpx

from ringsched.server.loading import LoadingResponder
from ringsched.server.serve import listen_socket


def test_the_port_answers_503_at_once_while_loading_and_keeps_its_socket():
    sock = listen_socket("127.0.0.1", 0, "--port")
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    with LoadingResponder(sock) as loading:
        start = time.monotonic()
        r = httpx.get(f"{url}/health", timeout=1)
        assert time.monotonic() - start < 1
        assert r.status_code == 503 and r.json() == {"status": "loading"}
        r = httpx.post(f"{url}/v1/chat/completions", json={"model": "m", "messages": []}, timeout=1)
        assert r.status_code == 503 and r.headers["retry-after"] == "5"
        assert r.json()["error"]["code"] == "loading" and r.json()["error"]["type"] == "service_unavailable_error"
        assert loading.answered == 2
    # After the block the socket still listens: a connection waits in its backlog for the HTTP server
    client = socket.create_connection(sock.getsockname()[:2], timeout=1)
    client.close()
    sock.close()
