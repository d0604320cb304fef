"""The HTTP front end over a fake ring: the real app, `EngineClient`, ZMQ sockets and uvicorn, in this process.

`FakeRing` stands where stage 0 would: it binds the `front-in` socket, reads `NewRequest`s and `AbortRequest`s,
and answers on `front-out` with `TokenOutput`s, one token per `step_s`, `max_tokens` of them, or as its `mode`
says. `FrontEnd` serves `create_app` on a free port from a thread of its own, so tests drive it with real HTTP
clients, fast, without a model or stage processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from dataclasses import dataclass, field

import uvicorn
import zmq

from ringsched.comm.messages import AbortRequest, NewRequest, OutputBatch, TokenOutput
from ringsched.comm.zmq_io import Puller, Pusher, ipc_addr, new_ipc_dir
from ringsched.config import EngineConfig
from ringsched.process.supervisor import StageFailure, free_port
from ringsched.server.app import create_app
from ringsched.server.engine_client import EngineClient
from ringsched.server.grammar_pool import GrammarPool, PoolConfig
from ringsched.server.http_limits import HttpLimits, uvicorn_config
from ringsched.server.metrics import ServerMetrics
from ringsched.server.protocol import Limits
from ringsched.server.serving import ServerContext
from ringsched.stage.channels import StageAddrs
from ringsched.tokenizer import Tokenizer


class FakeRecovery:
    """A `Recovery` that never runs (this ring replaces nothing)."""

    def __init__(self) -> None:
        self.running, self.front_paused = False, threading.Event()
        self.replaced: dict[int, int] = {}
        self.pauses: list[float] = []


class FakeSupervisor:
    """What `EngineClient` needs of a `Supervisor`: addresses, `check`, `stop`, its `recovery` and `generation`;
    `failure` makes `check` raise."""

    def __init__(self) -> None:
        self.ipc_dir = new_ipc_dir()
        d = self.ipc_dir
        self.addrs = StageAddrs(ipc_addr(d, "ctl"), ipc_addr(d, "front-in"), ipc_addr(d, "front-out"), ())
        self.info = {0: {"kv_tokens": 1 << 20}}
        self.stats: dict[int, dict] = {}
        self.ranks: list[int] = []
        self.procs: list = []
        self.failure: str | None = None
        self.recovery, self.generation = FakeRecovery(), 0

    def start(self) -> None:
        pass

    def check(self, timeout_ms: int = 0) -> None:
        if self.failure:
            raise StageFailure(self.failure)

    @property
    def alive(self) -> bool:
        return self.failure is None

    def stop(self, grace: float = 5.0) -> None:
        pass


@dataclass
class _Running:
    req: NewRequest
    left: int
    due: float


@dataclass
class FakeRing:
    """Stage 0's side of the front-end channels. `mode`: "run" (tokens flow), "hold" (requests are taken in,
    nothing comes out until the mode changes), "fail" (each new request ends with a `request_failed` error)."""

    addrs: StageAddrs
    step_s: float = 0.01
    token: int = 28  # the id every generated token has
    script: list[int] | None = None  # instead: a request's n-th token is script[n] (cyclically)
    mode: str = "run"
    first_delay_s: float = 0.0  # before a request's first token
    received: list[str] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._ctx = zmq.Context()
        self._in = Puller(self._ctx, self.addrs.front_in)
        self._out = Pusher(self._ctx, self.addrs.front_out)
        self._running: dict[str, _Running] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="fake-ring", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            msg = self._in.recv(timeout_ms=5)
            outs = []
            if isinstance(msg, NewRequest):
                self.received.append(msg.rid)
                if self.mode == "fail":
                    outs.append(TokenOutput(msg.rid, [], "error", "injected failure", len(msg.token_ids), 0,
                                            "request_failed"))  # fmt: skip
                else:
                    due = time.monotonic() + self.first_delay_s
                    self._running[msg.rid] = _Running(msg, msg.params["max_tokens"], due)
            elif isinstance(msg, AbortRequest):
                self.aborted.append(msg.rid)
                if self._running.pop(msg.rid, None) is not None:
                    outs.append(TokenOutput(msg.rid, [], "abort"))
            if self.mode == "run":
                outs += self._tokens_due()
            if outs:
                self._out.send(OutputBatch(outs))

    def _tokens_due(self) -> list[TokenOutput]:
        now, outs = time.monotonic(), []
        for rid, r in list(self._running.items()):
            if now < r.due:
                continue
            r.left -= 1
            r.due = now + self.step_s
            done = r.left == 0
            n = r.req.params["max_tokens"] - r.left
            token = self.script[(n - 1) % len(self.script)] if self.script else self.token
            outs.append(TokenOutput(rid, [token], "length" if done else None, None, len(r.req.token_ids), n))
            if done:
                del self._running[rid]
        return outs

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._in.close()
        self._out.close(linger_ms=0)
        self._ctx.destroy(linger=0)


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):  # signals stay the test runner's
        yield


class FrontEnd:
    """The real app on 127.0.0.1:`port` over a `FakeRing`; `ctx` is its `ServerContext` (tests may edit it)."""

    def __init__(self, model_dir: str, max_running: int = 16, max_queued: int | None = None,
                 max_request_bytes: int = 1 << 20, max_len: int = 2048, api_key: str | None = None,
                 http: HttpLimits = HttpLimits(), grammar_workers: int = 1,
                 max_request_tokens: int | None = None) -> None:  # fmt: skip
        self.supervisor = FakeSupervisor()
        self.ring = FakeRing(self.supervisor.addrs)
        cfg = EngineConfig(max_running_requests=max_running)
        client = EngineClient(cfg, None, supervisor=self.supervisor)
        tok = Tokenizer(model_dir)
        limits = Limits(max_len, 1 << 20, tok.vocab_size, "m", max_request_tokens)
        pool = GrammarPool(PoolConfig(model_dir, tok.vocab_size, (), grammar_workers)) if grammar_workers else None
        self.ctx = ServerContext(client, tok, ServerMetrics(), limits, api_key, max_queued, max_request_bytes, http,
                                 pool)  # fmt: skip
        self.port = free_port()
        config = uvicorn_config(create_app(self.ctx), self.ctx.http, host="127.0.0.1", port=self.port,
                                log_config=None, lifespan="off", timeout_graceful_shutdown=1)  # fmt: skip
        self.server = _Server(config)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_until_complete, args=(self._main(),), daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the in-process front end did not start")
            time.sleep(0.02)

    async def _main(self) -> None:
        self.ctx.client.start_routing()
        try:
            await self.server.serve()
        finally:
            if self.ctx.grammars is not None:
                await self.ctx.grammars.close()
            await self.ctx.client.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def num_open(self) -> int:
        return self.ctx.client.num_open

    def wait_open(self, n: int = 0, timeout: float = 10.0) -> int:
        """Wait until the open count is `n`; return what it is then."""
        deadline = time.monotonic() + timeout
        while self.num_open != n and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.num_open

    def wait_aborted(self, n: int, timeout: float = 10.0) -> int:
        """Wait until the ring has received at least `n` aborts (they travel over ZMQ after the release);
        return how many it has."""
        deadline = time.monotonic() + timeout
        while len(self.ring.aborted) < n and time.monotonic() < deadline:
            time.sleep(0.02)
        return len(self.ring.aborted)

    def close(self) -> None:
        self.server.should_exit = True
        self._thread.join(10)
        self.ring.close()
