"""Connections are bounded: how long a client may take to send its headers and its body, how long an idle keep-alive
connection stays open, and how many connections may be open at once.

Contract: `bounded_protocol(limits)` is uvicorn's h11 protocol class with three rules added (`BoundedH11Protocol`). A
connection opened while `max_connections` are open gets a 503 (OpenAI's error JSON) and is closed at once. A request's
headers must be complete within `header_timeout` seconds of the connection opening, or of their first byte after a
previous response; otherwise the client gets a 408 and the connection is closed (a client that sends nothing, or a byte
a second, holds nothing for long). An idle keep-alive connection is closed after `keep_alive_timeout` (uvicorn's own
timer). The body's deadline, `body_timeout`, is the endpoints' (it is read there, as a stream: `intake.read_body`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger("ringsched.server")

_WARN_EVERY_S = 10.0  # refused connections are logged at most this often: a flood must not fill the log


@dataclass(frozen=True)
class HttpLimits:
    header_timeout: float = 10.0
    body_timeout: float = 60.0
    keep_alive_timeout: float = 5.0
    max_connections: int = 1024


def _response(status: str, message: str, kind: str, code: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()
    head = (
        f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode() + body


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the connection limit and the header timeout; `bounded_protocol` makes the
    subclass that carries one server's `limits` and its two canned answers."""

    limits: HttpLimits
    too_many: bytes
    too_slow: bytes
    _header_timer: asyncio.TimerHandle | None = None
    _warned = [0.0]  # when a refused connection was last logged, for every connection of the server

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        full = len(self.connections) >= self.limits.max_connections
        super().connection_made(transport)
        if full:
            if time.monotonic() - self._warned[0] > _WARN_EVERY_S:
                self._warned[0] = time.monotonic()
                logger.warning("refusing connections: %d are open (--max-connections)", self.limits.max_connections)
            transport.write(self.too_many)
            transport.close()
            return
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._header_timer is None and self._between_requests():
            self._arm()
        super().data_received(data)
        if not self._between_requests():  # the headers are in: the body's deadline is the endpoint's
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _between_requests(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm(self) -> None:
        self._header_timer = self.loop.call_later(self.limits.header_timeout, self._headers_too_slow)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if self._between_requests() and not self.transport.is_closing():
            self.transport.write(self.too_slow)
            self.transport.close()


def bounded_protocol(limits: HttpLimits) -> type[H11Protocol]:
    too_many = _response(
        "503 Service Unavailable",
        f"The server has {limits.max_connections} connections open (--max-connections); try again later",
        "service_unavailable_error",
        "too_many_connections",
    )
    too_slow = _response(
        "408 Request Timeout",
        f"The request's headers did not arrive within {limits.header_timeout:g} s (--http-header-timeout)",
        "invalid_request_error",
        "request_timeout",
    )
    fields = {"limits": limits, "too_many": too_many, "too_slow": too_slow, "_warned": [0.0]}
    return type("ServerH11Protocol", (BoundedH11Protocol,), fields)


def uvicorn_config(app: object, limits: HttpLimits, **kwargs: object) -> uvicorn.Config:
    """uvicorn's config for `app` with these bounds on its connections."""
    return uvicorn.Config(app, http=bounded_protocol(limits), timeout_keep_alive=limits.keep_alive_timeout, **kwargs)
