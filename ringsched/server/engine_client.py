"""The front end's link to the ring: starts the stages, sends requests and aborts, routes their tokens.

Contract: `EngineClient(cfg, spec)` starts every stage (blocking, as the offline `Engine` does) and binds
the output socket; `client.start_routing()`, called on the server's event loop, starts the task that routes each
`TokenOutput` to the queue of its request and watches the stages. `generate(rid, ids, params)` yields a
request's `TokenOutput`s until one carries a `finish_reason`; it raises `EngineError` when the request ends in
an error or was aborted by anyone but its caller. Leaving the iteration early (the client went away) aborts the
request on the ring, which frees its KV on every stage. When a stage dies, every open request ends with an
`EngineError`, `healthy` turns False and `on_failure` is called. `replay_open()` resubmits every open request to a
fresh ring (`replay.py`). `shutdown(timeout)` lets running requests finish for up to `timeout` seconds,
ends the rest with an error, and stops every stage process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import signal
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

import zmq
import zmq.asyncio

from ringsched.comm.messages import AbortRequest, NewRequest, OutputBatch, TokenOutput, decode
from ringsched.config import EngineConfig
from ringsched.link import RingLink
from ringsched.process.supervisor import StageFailure, Supervisor
from ringsched.replay import FollowRecovery, OpenRequests
from ringsched.sampling.params import SamplingParams
from ringsched.spec import ModelSpec

logger = logging.getLogger("ringsched.server")

_WATCH_PERIOD_S = 0.25  # how often the stages' status channel is read: sets how fast a dead stage is seen


class EngineError(RuntimeError):
    """A request that could not be served. `status` is the HTTP status a non-streaming reply carries, `code` the
    error's OpenAI `code` string (None for plain refusals)."""

    def __init__(self, message: str, status: int = 500, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code = status, code

    @property
    def type(self) -> str:
        kinds = {400: "invalid_request_error", 500: "internal_server_error"}
        return kinds.get(self.status, "service_unavailable_error")


def _shutting_down() -> EngineError:
    return EngineError("the request was aborted: the server is shutting down", 503, "shutting_down")


@dataclass
class _Open:
    """One admitted request: its queue of outputs, and how far it got (an abort is owed once it was sent)."""

    queue: asyncio.Queue
    sent: bool = False
    done: bool = False


@dataclass
class RequestCounters:
    """Front-end totals since start, for metrics and the throughput log."""

    prompt_tokens: int = 0
    generation_tokens: int = 0


class EngineClient:
    def __init__(self, cfg: EngineConfig, spec: ModelSpec, supervisor: Supervisor | None = None) -> None:
        """`supervisor`: one not yet started, to run the stages some other way (tests stand in a fake ring)."""
        self.cfg = cfg
        self._open: dict[str, _Open] = {}  # admitted and not yet released: the one count of open requests
        self._task: asyncio.Task | None = None
        self.sched_stats: dict = {}  # stage 0's latest scheduler gauges
        self.counters = RequestCounters()
        self._seeds = random.Random(cfg.seed)  # seeds the unseeded random requests, in arrival order
        self.open_requests = OpenRequests()  # what `replay_open` resubmits
        self.healthy = False
        self.accepting = False
        self.failure: str | None = None
        self.on_failure: Callable[[str], None] | None = None
        self._closed = False
        # Starts the stages (blocking); `start_routing()` wraps its output socket for asyncio on the server's loop.
        self.link = RingLink(cfg, spec, supervisor)
        self.supervisor = self.link.supervisor
        self._recovery = FollowRecovery(self.supervisor, self.link)
        self._replay: asyncio.Task | None = None  # the replay after a recovery (it restarts routing)
        self.healthy = self.accepting = True

    # -- the background task ------------------------------------------------------------------------------
    def start_routing(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._route(), name="engine-client")
        self._task.add_done_callback(self._route_ended)

    def _route_ended(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None and self.failure is None:
            self._fail(f"the front end's output task failed: {task.exception()!r}")

    async def _route(self) -> None:
        """Route outputs to their requests' queues, and watch the stages, until cancelled by `close()`."""
        sock = zmq.asyncio.Socket.from_socket(self.link.out.sock)
        watch = asyncio.create_task(self._watch())
        try:
            while not self._closed:
                msg = decode(await sock.recv(copy=False))
                assert isinstance(msg, OutputBatch), f"unexpected message on the output channel: {msg!r}"
                if msg.stats:
                    self.sched_stats = msg.stats
                for out in msg.outputs:
                    req = self._open.get(out.rid)
                    if req is not None:  # None: its caller left (an abort's acknowledgement, say)
                        self.open_requests.delivered(out)
                        req.queue.put_nowait(out)
        finally:
            watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watch
            sock.close(linger=0)  # unregisters it from the loop

    async def _watch(self) -> None:
        while not self._closed:
            try:
                self.supervisor.check()
            except StageFailure as e:
                self._fail(str(e))
                return
            if self._recovery.step():  # a replaced rank: the ring is whole again; the replay restarts routing
                self._replay = asyncio.create_task(self.replay_open())
                return
            await asyncio.sleep(_WATCH_PERIOD_S)

    def _fail(self, error: str) -> None:
        first, _, details = error.partition("\n")
        # A stage killed from outside reports nothing, and its peer's report ("connection reset") would hide
        # the cause: name the killed stages first.
        killed = [
            f"stage {rank} (pid {p.pid}) was killed by {signal.Signals(-p.exitcode).name}"
            for rank, p in zip(self.supervisor.ranks, self.supervisor.procs, strict=True)
            if p.exitcode is not None and p.exitcode < 0 and f"pid {p.pid}" not in first
        ]
        summary = "; then ".join([*killed, first])
        self.failure, self.healthy, self.accepting = summary, False, False
        logger.error("the engine failed, ending %d open request(s) with an error: %s", len(self._open), summary)
        if details:
            logger.error("details:\n%s", details)
        self._end_all(EngineError(f"the engine failed: {summary}", 503, "engine_failed"))
        if self.on_failure:
            self.on_failure(summary)

    def _end_all(self, error: EngineError) -> None:
        """End every open request with `error`; aborting each frees its KV on the ring if the ring still runs."""
        for rid, req in list(self._open.items()):
            if req.sent:
                self.link.send(AbortRequest(rid))
            req.queue.put_nowait(error)

    # -- requests -----------------------------------------------------------------------------------------
    @property
    def num_open(self) -> int:
        """Requests admitted and not yet released: counted at the door, before any await."""
        return len(self._open)

    def num_waiting(self) -> int:
        """Requests not yet admitted by stage 0: beyond its running limit for sure, or as it last reported."""
        over = max(self.num_open - self.cfg.max_running_requests, 0)
        return max(over, int(self.sched_stats.get("waiting", 0)))

    def admit(self, rid: str, max_queued: int | None = None) -> None:
        """Count `rid` as open, or refuse it (503 when unavailable or when `max_queued` requests would already
        wait beyond `max_running_requests`). Synchronous, so a burst is counted exactly. Pair with `release`."""
        if not self.healthy:
            raise EngineError(f"the engine is not available: {self.failure}", 503, "engine_failed")
        if not self.accepting:
            raise EngineError("the server is shutting down", 503, "shutting_down")
        if rid in self._open:
            raise EngineError(f"request id {rid!r} is already in use", 400)
        if max_queued is not None and self.num_open >= self.cfg.max_running_requests + max_queued:
            waiting = self.num_open - self.cfg.max_running_requests
            raise EngineError(
                f"the server is busy: {waiting} requests are waiting (--max-queued-requests {max_queued}); retry later",
                503,
                "queue_full",
            )
        self._open[rid] = _Open(asyncio.Queue())

    def release(self, rid: str) -> None:
        """Forget `rid` (idempotent); if it reached the ring and did not finish there, abort it, which frees its KV
        on every stage."""
        req = self._open.pop(rid, None)
        self.open_requests.ended(rid)
        if req is not None and req.sent and not req.done:
            self.abort(rid)

    async def generate(self, rid: str, token_ids: Sequence[int], params: SamplingParams) -> AsyncIterator[TokenOutput]:
        """The outputs of admitted request `rid` until one carries a finish reason; released however it ends."""
        try:
            req = self._open.get(rid)
            if req is None:
                raise EngineError(f"request {rid!r} was not admitted (or was already released)", 500)
            new = NewRequest(rid, list(token_ids), params.seeded(self._seeds).to_dict())
            self.open_requests.sent(new)
            self.link.send(new)
            req.sent = True
            self.counters.prompt_tokens += len(token_ids)
            while True:
                out = await req.queue.get()
                if isinstance(out, EngineError):  # ended by the front end (shutdown, a dead stage): aborted there
                    req.done = True
                    raise out
                self.counters.generation_tokens += len(out.token_ids)
                if out.finish_reason == "error":  # stage 0 refused it, or it failed on a stage: this request only
                    req.done = True
                    status = 400 if out.error_code is None else 500  # a refusal has no code; a failure has one
                    raise EngineError(out.error or "the request failed", status, out.error_code)
                if out.finish_reason == "abort":  # not ours (we release first): the ring is stopping
                    req.done = True
                    raise _shutting_down()
                req.done = out.finish_reason is not None
                yield out
                if req.done:
                    return
        finally:
            self.release(rid)  # a caller that stopped early gets its request aborted on the ring

    def abort(self, rid: str) -> None:
        if not self._closed:
            self.link.send(AbortRequest(rid))

    async def replay_open(self) -> int:
        """Resubmit every open request to a fresh ring (a replaced rank, a fresh stage 0) with the tokens
        already routed to it; returns how many (`requests_replayed` counts them all). Routing stops while both
        sockets to stage 0 are re-created (`RingLink.reconnect`: nothing queued for the old stage 0 reaches the fresh
        one, the old ring's outputs not yet routed are dropped), then resumes. A request's queue, detokenizer and
        stop strings carry on: its stream sees a pause, then the next tokens. Nothing here detects the failure:
        whoever replaces the rank calls this."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.link.reconnect()
        replays = self.open_requests.replays()
        for new in replays:
            self.link.send(new)
        if self._task is not None:
            self.start_routing()
        return len(replays)

    @property
    def requests_replayed(self) -> int:
        return self.open_requests.replayed

    # -- stats --------------------------------------------------------------------------------------------
    def stage_stats(self) -> dict[int, dict]:
        """Per stage: kv_usage, busy_fraction, bubble_fraction of its last report."""
        return dict(self.supervisor.stats)

    def kv_capacity_tokens(self) -> int:
        """KV tokens a request can use: every stage allocates the smallest pool (with --cp-size, a request's KV is
        spread over its stage's CP ranks: `request_kv_tokens`)."""
        return min(i.get("request_kv_tokens", i["kv_tokens"]) for i in self.supervisor.info.values())

    # -- lifecycle ----------------------------------------------------------------------------------------
    async def drain(self, timeout: float) -> None:
        """Stop accepting; wait up to `timeout` s for open requests; end the rest with an error."""
        self.accepting = False
        deadline = time.monotonic() + timeout
        if self._open:
            logger.info("shutting down: waiting up to %.0fs for %d open request(s)", timeout, len(self._open))
        while self._open and time.monotonic() < deadline and self.healthy:
            await asyncio.sleep(0.05)
        if self._open:
            logger.warning("shutting down: aborting %d unfinished request(s)", len(self._open))
            self._end_all(_shutting_down())

    async def close(self) -> None:
        """Stop every stage process (blocking work, run off the loop) and close the sockets."""
        if self._closed:
            return
        self._closed = True
        self.accepting = self.healthy = False
        if self._task is not None:  # before stopping: the task reads the status channel stop() closes
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await asyncio.to_thread(self.link.close)

    def close_sync(self) -> None:
        """For exits that never reached the event loop (or left it by an exception)."""
        self._closed = True
        self.link.close()
