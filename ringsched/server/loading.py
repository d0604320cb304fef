"""While the stages load (seconds on a small model, minutes on a large one), the HTTP port already answers: every
request gets a 503 at once, `/health` with `{"status": "loading"}` and the others with the OpenAI error JSON, so a
probe with a short timeout learns that the server is alive and not ready, instead of waiting in the socket's
backlog. The same listening socket is handed to the HTTP server afterwards: no connection is refused between."""

from __future__ import annotations

import json
import select
import socket
import threading

POLL_S = 0.1
READ_S = 1.0  # a client that sends its request slower than this gets its 503 anyway


def _response(path: str) -> bytes:
    if path.split("?")[0] == "/health":
        body = {"status": "loading"}
    else:
        message = "the model is loading; retry in a few seconds (/health says when it serves)"
        body = {"error": {"message": message, "type": "service_unavailable_error", "param": None, "code": "loading"}}
    data = json.dumps(body).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 5\r\n"
        f"content-length: {len(data)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + data


class LoadingResponder:
    """`with LoadingResponder(sock):` answers 503 on the listening `sock` from a thread until the block ends."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ringsched-loading", daemon=True)
        self.answered = 0

    def __enter__(self) -> LoadingResponder:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            ready, _, _ = select.select([self.sock], [], [], POLL_S)
            if not ready or self._stop.is_set():
                continue
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                continue
            with conn:
                self._answer(conn)

    def _answer(self, conn: socket.socket) -> None:
        conn.settimeout(READ_S)
        data = b""
        try:
            while b"\r\n" not in data and len(data) < 8192:
                chunk = conn.recv(4096)
                if not chunk:
                    break
                data += chunk
        except OSError:  # a timeout, a reset: answer what was read
            pass
        parts = data.split(b" ", 2)
        path = parts[1].decode("latin-1") if len(parts) > 1 else "/"
        try:
            conn.sendall(_response(path))
            self.answered += 1
        except OSError:
            pass
