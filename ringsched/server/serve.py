"""`run_server(cfg, ...)`: start the stages, serve HTTP on uvicorn with uvloop, and leave nothing behind.

Contract: blocks until the server stops and returns the process exit code: 0 after SIGTERM or Ctrl-C, 1 when a
stage failed (the error is logged), 130 when SIGTERM or Ctrl-C came while the stages were still loading. On the
first SIGTERM or SIGINT it stops accepting connections, lets running requests finish for up to
`shutdown_timeout` seconds, ends the rest with an error chunk, and stops every stage process; a second signal
skips the wait. Logs: each stage's layers, weights and KV capacity (from the Supervisor), the URL, then a
throughput line every few seconds while busy.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import uvicorn
import uvloop

from ringsched.config import EngineConfig
from ringsched.models.fetch import DEFAULT_MODEL
from ringsched.server.app import create_app
from ringsched.server.engine_client import EngineClient
from ringsched.server.metrics import ServerMetrics, log_throughput
from ringsched.server.protocol import Limits
from ringsched.server.serving import DEFAULT_MAX_REQUEST_BYTES, ServerContext
from ringsched.spec import ModelSpec
from ringsched.tokenizer import Tokenizer

logger = logging.getLogger("ringsched.server")

_FLUSH_S = 2.0  # after requests are ended with an error, how long their streams get to send it


class _Server(uvicorn.Server):
    """uvicorn's server, minus its signal handling: ours drains the engine before uvicorn is told to exit."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def default_model_name(model: str, model_dir: str) -> str:
    return DEFAULT_MODEL if model == DEFAULT_MODEL else Path(model_dir).name


def run_server(
    cfg: EngineConfig,
    spec: ModelSpec | None = None,
    host: str = "127.0.0.1",
    port: int = 30000,
    api_key: str | None = None,
    served_model_name: str | None = None,
    max_queued_requests: int | None = None,
    shutdown_timeout: float = 30.0,
    log_level: str = "info",
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
) -> int:
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if max_queued_requests is not None and max_queued_requests < 0:
        raise ValueError(f"--max-queued-requests must be >= 0, got {max_queued_requests}")
    if shutdown_timeout < 0:
        raise ValueError(f"--shutdown-timeout must be >= 0 seconds, got {shutdown_timeout}")
    if max_request_bytes < 1:
        raise ValueError(f"--max-request-bytes must be >= 1, got {max_request_bytes}")
    spec = spec or ModelSpec.resolve(cfg, quiet=False)  # the launcher resolved it already
    model_dir = spec.model_dir
    cfg = replace(cfg, log_level=log_level)  # the stages log at the server's level
    tokenizer = Tokenizer(model_dir)
    name = served_model_name or default_model_name(cfg.model, model_dir)

    # Until the event loop owns the signals, SIGTERM interrupts loading like Ctrl-C: the stages are stopped.
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        client = EngineClient(cfg, spec)
    except KeyboardInterrupt:
        logger.warning("interrupted while the stages were loading; every stage is stopped")
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    try:
        limits = Limits(spec.context_len, client.kv_capacity_tokens(), spec.config.vocab_size, name)
        ctx = ServerContext(
            client, tokenizer, ServerMetrics(), limits, api_key, max_queued_requests, max_request_bytes
        )
        return uvloop.run(_serve(ctx, host, port, shutdown_timeout, log_level))
    finally:
        client.close_sync()  # a no-op after a normal exit; stops the stages after an exception


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


async def _serve(ctx: ServerContext, host: str, port: int, shutdown_timeout: float, log_level: str) -> int:
    client = ctx.client
    config = uvicorn.Config(
        create_app(ctx),
        host=host,
        port=port,
        log_config=None,  # keep the process's logging setup
        log_level=log_level,
        access_log=log_level == "debug",
        timeout_graceful_shutdown=5,
    )
    server = _Server(config)
    exit_code = 0
    loop = asyncio.get_running_loop()
    stopping: list[asyncio.Task] = []

    def stop(reason: str, drain_s: float) -> None:
        if stopping:  # a second signal: skip the wait
            logger.warning("%s again: ending every request now", reason)
            client.accepting = False
            stopping.append(loop.create_task(client.drain(0)))
            return
        stopping.append(loop.create_task(_shut_down(server, client, reason, drain_s)))

    def on_failure(message: str) -> None:
        nonlocal exit_code
        exit_code = 1
        stop("a stage failed", 0)

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop, signal.Signals(sig).name, shutdown_timeout)
    client.on_failure = on_failure
    client.start_routing()
    throughput = loop.create_task(log_throughput(client))
    serving = loop.create_task(server.serve())
    await _until(lambda: server.started or serving.done(), 600)
    if server.started:
        logger.info("serving %s at http://%s:%d (OpenAI API under /v1)", ctx.model_name, host, port)
    try:
        await serving  # uvicorn's own startup failures (port in use) raise SystemExit here
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        throughput.cancel()
        await client.close()
        logger.info("stopped: every stage process has exited")
    return exit_code


async def _shut_down(server: uvicorn.Server, client: EngineClient, reason: str, drain_s: float) -> None:
    logger.warning("%s: shutting down, no new connections", reason)
    for s in getattr(server, "servers", []):
        s.close()  # stop listening; open connections (streams among them) stay
    await client.drain(drain_s)
    await _until(lambda: client.num_open == 0, _FLUSH_S)
    server.should_exit = True


async def _until(done: Callable[[], bool], timeout: float) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not done() and loop.time() < deadline:
        await asyncio.sleep(0.05)
