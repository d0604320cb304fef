"""How the nodes take part in a recovery (`process/recovery.py`), through the rendezvous store.

Each node's supervisor replaces its own ranks; node 0's, the coordinator, decides when a pass starts and when the
next generation of the ring is published. One pass, on every node at once:

1. `begin`: node 0 writes `ring/next` (the generation the pass builds); another node that saw a failure of its
   own asks for a pass (`ring/requests`) and waits for that key.
2. Each node kills its failed ranks and moves its survivors out of the ring, then says which ranks it replaces
   (`left`: `ring/left/<gen>/<node>`). Node 0 waits for every node's answer up to `--rejoin-timeout`: a node whose
   launcher is gone answers once it is started again with the same flags and `--node-rank`
   (`Recovery.join_running`).
3. Node 0 publishes the generation (`rejoin.publish_generation`); every node waits for its ranks to be ready and
   says so, with any that failed meanwhile (`ready`: `ring/ready/<gen>/<node>`), which starts the next pass.

With one node there is nothing to coordinate (`OneNode`).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable

from ringsched.stage import rejoin

NEXT_KEY, REQUESTS_KEY, STARTED_KEY = "ring/next", "ring/requests", "ring/started"
POLL_S = 0.1
ANSWER_S = 3.0  # a live node answers a pass within this; one that does not is waited for as gone
READY_TIMEOUT_S = 600.0  # a replacement loads its layers as at start-up

logger = logging.getLogger("ringsched.launch")


class NodesFailed(RuntimeError):
    pass


class OneNode:
    """One node: its supervisor is the whole recovery."""

    def __init__(self, store) -> None:
        self.store = store

    def begin(self, generation: int) -> int:
        return generation

    def left(self, generation: int, failed: dict[int, str], restart: bool = False) -> tuple[dict[int, str], int]:
        """The other nodes' failed ranks and how many restarts they count (none here)."""
        return {}, 0

    def publish(self, generation: int) -> None:
        rejoin.publish_generation(self.store)

    def ready(self, generation: int, failed: dict[int, str]) -> dict[int, str]:
        return {}

    def pending(self, generation: int) -> bool:
        """Whether another node wants a pass this node has not run."""
        return False


class _Nodes:
    def __init__(
        self,
        store,
        node: int,
        nnodes: int,
        rejoin_timeout: float,
        stopped: Callable[[], str | None],
        describe_node: Callable[[int], str],
        last_seen: Callable[[int], float] | None = None,
    ) -> None:
        self.store, self.node, self.nnodes = store, node, nnodes
        self.rejoin_timeout, self.stopped, self.describe_node = rejoin_timeout, stopped, describe_node
        self.last_seen = last_seen or (lambda n: time.monotonic())  # when node n was last heard from

    def _wait(self, key: str, deadline: float, why: Callable[[], str] | None = None) -> bytes | None:
        """`key`'s value once it is set; at `deadline`, `NodesFailed(why())`, or None without `why`."""
        while not self.store.check([key]):
            if self.stopped() is not None:
                raise NodesFailed(f"node 0 stopped the ring: {self.stopped() or 'shut down'}")
            if time.monotonic() > deadline:
                if why is None:
                    return None
                raise NodesFailed(why())
            time.sleep(POLL_S)
        return self.store.get(key)

    def _put(self, kind: str, generation: int, failed: dict[int, str], restart: bool = False) -> None:
        self.store.set(f"ring/{kind}/{generation}/{self.node}", json.dumps({"failed": failed, "restart": restart}))


class Coordinator(_Nodes):
    """Node 0 of several."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.handled = 0  # passes asked for by the other nodes, up to the last one begun

    def begin(self, generation: int) -> int:
        self.handled = int(self.store.add(REQUESTS_KEY, 0))
        self.store.set(NEXT_KEY, str(generation))
        return generation

    def left(self, generation: int, failed: dict[int, str], restart: bool = False) -> tuple[dict[int, str], int]:
        now = time.monotonic()
        theirs, restarts = {}, 0
        for n in range(1, self.nnodes):
            # --rejoin-timeout counts from the node's last sign of life, not from when its silence was noticed
            deadline = min(now, self.last_seen(n)) + self.rejoin_timeout
            if self._wait(f"ring/left/{generation}/{n}", time.monotonic() + ANSWER_S) is None:
                logger.warning(
                    "%s has not answered: waiting up to --rejoin-timeout %gs from its last sign of life for it to "
                    "come back (a cut link restored, or its launcher started again with the same flags)",
                    self.describe_node(n),
                    self.rejoin_timeout,
                )
            said = json.loads(
                self._wait(
                    f"ring/left/{generation}/{n}",
                    deadline,
                    lambda n=n: (
                        f"{self.describe_node(n)} did not come back within --rejoin-timeout {self.rejoin_timeout:g}s: "
                        f"start its launcher again with the same flags and --node-rank {n}, or raise --rejoin-timeout"
                    ),
                )
            )
            failed_there = {int(r): cause for r, cause in said["failed"].items()}
            theirs |= failed_there
            restarts += 1 if said["restart"] else len(failed_there)  # a node started again counts once
        return theirs, restarts

    def publish(self, generation: int) -> None:
        published = rejoin.publish_generation(self.store)
        assert published == generation, (published, generation)

    def ready(self, generation: int, failed: dict[int, str]) -> dict[int, str]:
        deadline, theirs = time.monotonic() + READY_TIMEOUT_S, {}
        for n in range(1, self.nnodes):
            said = json.loads(
                self._wait(
                    f"ring/ready/{generation}/{n}",
                    deadline,
                    lambda n=n: f"{self.describe_node(n)} was not ready again after {READY_TIMEOUT_S:.0f}s",
                )
            )
            theirs |= {int(r): cause for r, cause in said["failed"].items()}
        return theirs

    def pending(self, generation: int) -> bool:
        return int(self.store.add(REQUESTS_KEY, 0)) > self.handled  # the store is this node's: no wait


class Follower(_Nodes):
    """A node other than 0: it asks for a pass when it sees a failure, and follows node 0's."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.next = 0  # `ring/next` as the rendezvous heartbeat last read it (`watch`)

    def begin(self, generation: int) -> int:
        if self._next() < generation:
            self.store.add(REQUESTS_KEY, 1)
        deadline = time.monotonic() + self.rejoin_timeout
        while (gen := self._next()) < generation:
            if self.stopped() is not None:
                raise NodesFailed(f"node 0 stopped the ring: {self.stopped() or 'shut down'}")
            if time.monotonic() > deadline:
                raise NodesFailed(
                    f"node 0 began no recovery within {self.rejoin_timeout:g}s of node {self.node}'s request"
                )
            time.sleep(POLL_S)
        return gen

    def _next(self) -> int:
        return int(self.store.get(NEXT_KEY)) if self.store.check([NEXT_KEY]) else 0

    def left(self, generation: int, failed: dict[int, str], restart: bool = False) -> tuple[dict[int, str], int]:
        self._put("left", generation, failed, restart)
        return {}, 0

    def publish(self, generation: int) -> None:
        pass

    def ready(self, generation: int, failed: dict[int, str]) -> dict[int, str]:
        self._put("ready", generation, failed)
        return {}

    def watch(self) -> None:
        """From the rendezvous heartbeat thread (a store call may block on a cut link; the supervisor's must not)."""
        self.next = self._next()

    def pending(self, generation: int) -> bool:
        return self.next > generation


def nodes_for(cfg, store, stopped: Callable[[], str | None], last_seen: Callable[[int], float] | None = None):
    """This node's part in a recovery (`last_seen(n)`: when node n was last heard from)."""
    if cfg.nnodes == 1:
        return OneNode(store)
    spn = cfg.stages_per_node

    def describe(n: int) -> str:
        return f"node {n} (stages {n * spn}-{(n + 1) * spn - 1})"

    kind = Coordinator if cfg.node_rank == 0 else Follower
    return kind(store, cfg.node_rank, cfg.nnodes, cfg.rejoin_timeout, stopped, describe, last_seen)


def ring_started(store) -> bool:
    """Whether a ring has run on this store (a node launched now is rejoining it)."""
    return store.check([STARTED_KEY])


def mark_started(store) -> None:
    store.set(STARTED_KEY, "1")
