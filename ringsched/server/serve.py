"""`run_server(cfg, spec, opts)`: take the HTTP port, start the stages, serve HTTP on uvicorn with uvloop, and leave
nothing behind.

Contract: raises `PortInUse` before any stage starts when the HTTP port (or, on node 0 of several, the rendezvous port)
is taken. Otherwise blocks until the server stops and returns the process exit code: 0 after SIGTERM or Ctrl-C, 1 when a
stage failed (the error is logged), 130 when SIGTERM or Ctrl-C came while the stages were still loading. On the first
SIGTERM or SIGINT it stops accepting connections, lets running requests finish for up to `shutdown_timeout` seconds,
ends the rest with an error chunk, and stops every stage process; a second signal skips the wait. Logs: each stage's
layers, weights and KV capacity (from the Supervisor), the URL, then a throughput line every few seconds while busy.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import uvicorn
import uvloop

from ringsched.config import DEFAULT_MODEL, EngineConfig
from ringsched.server.app import create_app
from ringsched.server.engine_client import EngineClient
from ringsched.server.grammar_pool import GrammarPool, PoolConfig
from ringsched.server.http_limits import uvicorn_config
from ringsched.server.loading import LoadingResponder
from ringsched.server.metrics import ServerMetrics, log_throughput
from ringsched.server.options import ServerOptions
from ringsched.server.protocol import Limits
from ringsched.server.request_limits import model_sampling_defaults
from ringsched.server.serving import ServerContext
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


class PortInUse(RuntimeError):
    """A port the server must listen on is taken; raised before any stage starts."""


def listen_socket(host: str, port: int, flag: str) -> socket.socket:
    """A socket bound to `host:port` and listening, or `PortInUse` naming the flag. The HTTP port is taken before
    any stage loads, and the same socket is served on, so no one can take it in between."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise PortInUse(
            f"cannot listen on {host}:{port} ({flag}): {e.strerror}; stop what holds it or pick another {flag}"
        ) from None
    return sock


def check_rendezvous_port(cfg: EngineConfig) -> None:
    """Node 0 hosts the rendezvous store at `--dist-init-addr`: its port must be free before any stage starts."""
    if cfg.nnodes > 1 and cfg.node_rank == 0 and cfg.dist_init_addr:
        host, _, port = cfg.dist_init_addr.rpartition(":")
        if port.isdigit():
            listen_socket("0.0.0.0", int(port), "--dist-init-addr").close()


def run_server(cfg: EngineConfig, spec: ModelSpec | None = None, opts: ServerOptions | None = None) -> int:
    opts = opts or ServerOptions()
    logging.basicConfig(level=opts.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    port = 30000 if opts.port is None else opts.port
    sock = listen_socket(opts.host, port, "--port")
    try:
        check_rendezvous_port(cfg)
        return _run(cfg, spec, opts, sock)
    finally:
        sock.close()


def _run(cfg: EngineConfig, spec: ModelSpec | None, opts: ServerOptions, sock: socket.socket) -> int:
    spec = spec or ModelSpec.resolve(cfg, quiet=False)  # the launcher resolved it already
    model_dir = spec.model_dir
    cfg = replace(cfg, log_level=opts.log_level)  # the stages log at the server's level
    tokenizer = Tokenizer(model_dir, opts.chat_template)
    name = opts.served_model_name or default_model_name(cfg.model, model_dir)

    # Until the event loop owns the signals, SIGTERM interrupts loading like Ctrl-C: the stages are stopped.
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        with LoadingResponder(sock):  # 503 at once meanwhile, /health included
            client = EngineClient(cfg, spec)
    except KeyboardInterrupt:
        logger.warning("interrupted while the stages were loading; every stage is stopped")
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    try:
        return uvloop.run(_serve(_context(spec, opts, client, tokenizer, name), sock, opts))
    finally:
        client.close_sync()  # a no-op after a normal exit; stops the stages after an exception


def _context(spec: ModelSpec, opts: ServerOptions, client: EngineClient, tokenizer: Tokenizer, name: str):
    """What every handler needs, from the engine's client and the server's flags."""
    auto_tools = opts.tool_call_parser if opts.enable_auto_tool_choice else None
    defaults = model_sampling_defaults(spec.model_dir) if opts.generation_config == "auto" else ()
    if defaults:
        logger.info("sampling defaults from the model's generation_config.json: %s", dict(defaults))
    vocab, kv = spec.config.vocab_size, client.kv_capacity_tokens()
    limits = Limits(
        spec.context_len, kv, vocab, name, opts.max_request_tokens, auto_tools, defaults, opts.reasoning_parser
    )
    grammars = None
    if opts.grammar_workers:
        grammars = GrammarPool(
            PoolConfig(
                spec.model_dir, vocab, spec.eos_ids, opts.grammar_workers, opts.grammar_timeout, opts.grammar_memory_mb
            )
        )
    return ServerContext(
        client,
        tokenizer,
        ServerMetrics(),
        limits,
        opts.api_key,
        opts.max_queued_requests,
        opts.max_request_bytes,
        opts.http,
        grammars,
        opts.reasoning_parser,
    )


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _http_server(ctx: ServerContext, opts: ServerOptions) -> _Server:
    # log_config=None: keep the process's logging setup
    config = uvicorn_config(
        create_app(ctx),
        ctx.http,
        log_config=None,
        log_level=opts.log_level,
        access_log=opts.log_level == "debug",
        timeout_graceful_shutdown=5,
    )
    return _Server(config)


async def _serve(ctx: ServerContext, sock: socket.socket, opts: ServerOptions) -> int:
    client, shutdown_timeout = ctx.client, opts.shutdown_timeout
    server = _http_server(ctx, opts)
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
    if ctx.grammars is not None:
        ctx.grammars.start()
    host, port = sock.getsockname()[:2]  # now: a SIGTERM at once closes the socket before the server has started
    serving = loop.create_task(server.serve(sockets=[sock]))
    await _until(lambda: server.started or serving.done(), 600)
    if server.started:
        logger.info("serving %s at http://%s:%d (OpenAI API under /v1)", ctx.model_name, host, port)
    try:
        await serving  # uvicorn's own startup failures (port in use) raise SystemExit here
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        throughput.cancel()
        if ctx.grammars is not None:
            await ctx.grammars.close()
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
