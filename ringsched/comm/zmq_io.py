"""ZMQ PUSH/PULL endpoints that speak `messages.encode`/`decode`. Addresses come from the config."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import uuid

import zmq

from ringsched.comm.messages import decode, encode

_IPC_DIR = re.compile(r"ringsched-(\d+)-[0-9a-f]{6}-")


def new_ipc_dir() -> str:
    """A private directory for this engine's ipc sockets (no ports to collide). Those an engine killed with
    SIGKILL left behind (their launcher's pid gone) are removed first."""
    sweep_ipc_dirs(tempfile.gettempdir())
    return tempfile.mkdtemp(prefix=f"ringsched-{os.getpid()}-{uuid.uuid4().hex[:6]}-")


def sweep_ipc_dirs(root: str) -> list[str]:
    """Remove `root`'s ipc directories whose launcher no longer runs; the names removed."""
    removed = []
    for name in os.listdir(root):
        m = _IPC_DIR.match(name)
        if m and not _running(int(m.group(1))):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            removed.append(name)
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def ipc_addr(ipc_dir: str, name: str) -> str:
    return f"ipc://{os.path.join(ipc_dir, name)}"


class Pusher:
    def __init__(self, ctx: zmq.Context, addr: str, bind: bool = False) -> None:
        self.sock = ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.LINGER, 1000)
        self.sock.setsockopt(zmq.SNDHWM, 0)  # never drop: plans and outputs must all arrive
        (self.sock.bind if bind else self.sock.connect)(addr)

    def send(self, msg: object) -> None:
        self.sock.send(encode(msg), copy=False)

    def close(self, linger_ms: int = 500) -> None:
        """Closing waits up to `linger_ms` for queued messages: a closed socket must not drop a Shutdown."""
        self.sock.close(linger=linger_ms)


class Fanout:
    """One message to several `Pusher`s (a stage's first rank: the plan to the next stage and to its own other
    ranks), encoded once."""

    def __init__(self, pushers: list[Pusher]) -> None:
        self.pushers = pushers

    def send(self, msg: object) -> None:
        data = encode(msg)
        for p in self.pushers:
            p.sock.send(data, copy=False)

    def close(self, linger_ms: int = 500) -> None:
        for p in self.pushers:
            p.close(linger_ms)


class Puller:
    def __init__(self, ctx: zmq.Context, addr: str, bind: bool = True) -> None:
        """`tcp://IP:*` binds a free port; `endpoint` then says which."""
        self.sock = ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        (self.sock.bind if bind else self.sock.connect)(addr)
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT) if bind else addr

    def recv(self, timeout_ms: int | None = None) -> object | None:
        """One message, or None after `timeout_ms` (None: wait forever)."""
        if timeout_ms is not None and not self.sock.poll(timeout_ms, zmq.POLLIN):
            return None
        return decode(self.sock.recv(copy=False).bytes)

    def drain(self) -> list[object]:
        out = []
        while self.sock.poll(0, zmq.POLLIN):
            out.append(decode(self.sock.recv(copy=False).bytes))
        return out

    def close(self) -> None:
        self.sock.close(linger=0)
