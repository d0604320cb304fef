"""The front end's one link to the ring, shared by the offline `Engine` and the server's `EngineClient`.

`RingLink(cfg, spec)` binds the socket stage 0's outputs come back on (before any stage starts, so no early
message is lost), connects the one requests and aborts go out on, and starts this node's stages through a
`Supervisor` (blocking until every stage is ready; a failure or Ctrl-C while loading stops them all). `send`
never blocks (a PUSH socket without a high-water mark), so it is safe in `finally` blocks; `recv` and `drain`
read outputs synchronously (the server wraps `out.sock` for asyncio instead); `reconnect` re-creates both sockets
for a fresh stage 0; `close` stops the stages and closes both sockets, once.
"""

from __future__ import annotations

import atexit

import zmq

from ringsched.comm.messages import OutputBatch
from ringsched.comm.zmq_io import Puller, Pusher
from ringsched.config import EngineConfig
from ringsched.process.supervisor import Supervisor
from ringsched.spec import ModelSpec


class RingLink:
    def __init__(self, cfg: EngineConfig, spec: ModelSpec, supervisor: Supervisor | None = None) -> None:
        """`supervisor`: one not yet started, to run the stages some other way (tests stand in a fake ring)."""
        self.supervisor = supervisor or Supervisor(cfg, spec)
        self.zctx = zmq.Context()
        self.out = Puller(self.zctx, self.supervisor.addrs.front_out)
        self.inp = Pusher(self.zctx, self.supervisor.addrs.front_in)
        self.closed = False
        # An engine still open when the interpreter exits (an uncaught error without `with`): stop the stages
        # first, as multiprocessing's own exit hook would wait forever on daemon stages that ignore SIGTERM.
        atexit.register(self.close)
        try:
            self.supervisor.start()
        except BaseException:  # Ctrl-C or SIGTERM while loading included: no stage may outlive us
            self.close()
            raise

    def send(self, msg: object) -> None:
        if not self.closed and self.inp is not None:  # paused: a recovery runs (`FollowRecovery`)
            self.inp.send(msg)

    def pause(self) -> None:
        """Stop sending to stage 0 until `reconnect`: the request socket closes with linger 0, so what is queued
        for a ring that failed is dropped, and `send` drops what comes meanwhile (the front end replays it)."""
        if self.inp is not None:
            self.inp.close(linger_ms=0)
            self.inp = None

    def recv(self, timeout_ms: int) -> OutputBatch | None:
        return self.out.recv(timeout_ms)

    def drain(self) -> list[OutputBatch]:
        return self.out.drain()

    def reconnect(self) -> None:
        """Close and re-create both sockets to stage 0, for a fresh stage 0 that replaced the old one.
        Requests and aborts still queued for the old one are dropped (linger 0), so none reaches the fresh one
        besides what is sent from now on; outputs of the old ring not yet read are dropped with the old outputs
        socket. The fresh stage 0 binds `front_in` and connects to `front_out` as the old one did; ZMQ queues what
        is sent before it binds."""
        if self.closed:
            return
        self.pause()
        self.out.close()
        self.out = Puller(self.zctx, self.supervisor.addrs.front_out)
        self.inp = Pusher(self.zctx, self.supervisor.addrs.front_in)

    def close(self) -> None:
        """Stop every stage of this node, then close the sockets (idempotent)."""
        if self.closed:
            return
        self.closed = True
        atexit.unregister(self.close)
        self.supervisor.stop()
        self.pause()
        self.out.close()
        self.zctx.destroy(linger=0)
