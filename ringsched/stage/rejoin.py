"""A surviving rank's way through the replacement of a failed one (`--max-restarts`).

When a rank of the ring dies, hangs or fails, its node's supervisor replaces it (`process/recovery.py`); every
other rank keeps its process and weights and leaves the broken generation of the ring: its loop stops where the
failure reached it (a neighbour lost, `PeerLost`) or at the supervisor's SIGUSR1 (`Rejoin`, raised by the next
liveness check: a rank waiting for a plan that will not come, or spinning in a shared-memory collective), it
reports `lost`, drops its requests and KV, closes its sockets and process group, and waits until the supervisor
publishes the next generation in the store. Then it connects like a starting rank, on the store keys of that
generation, beside the replacement.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable

GENERATION_KEY = "ring/generation"
POLL_S = 0.1


class Rejoin(RuntimeError):
    """The supervisor asked this rank to leave its generation of the ring."""


_asked = threading.Event()


def install() -> None:
    """SIGUSR1 from the supervisor asks this rank to rejoin (the handler only sets a flag: `check` raises)."""
    signal.signal(signal.SIGUSR1, lambda *_: _asked.set())


def check() -> None:
    if _asked.is_set():
        raise Rejoin("the supervisor is replacing a rank of the ring")


def asked() -> bool:
    return _asked.is_set()


def wait_generation(store, after: int, alive: Callable[[], None]) -> int:
    """Block until the store's generation is past `after` (the supervisor publishes it once every replacement is
    started and every survivor has left); `alive` raises when this process should stop instead. The signal that
    asked this rank to leave is forgotten here: the supervisor sends it before it publishes a generation."""
    while True:
        alive()
        gen = int(store.add(GENERATION_KEY, 0))
        if gen > after:
            _asked.clear()
            return gen
        time.sleep(POLL_S)


def publish_generation(store) -> int:
    """The supervisor's side: the next generation, to the store (returns it)."""
    return int(store.add(GENERATION_KEY, 1))
