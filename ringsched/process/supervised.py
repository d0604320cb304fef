"""What a recovery (`process/recovery.py`) and the diagnosis of a failure (`process/diagnosis.py`) read of, and do to,
the node's supervisor (`process/supervisor.py`), which hands them itself: written out here so that they need not
import the supervisor that imports them."""

from __future__ import annotations

import multiprocessing as mp
from typing import Protocol

from ringsched.comm.messages import StageStatus
from ringsched.config import EngineConfig
from ringsched.process.rendezvous import Rendezvous
from ringsched.process.ring_nodes import Coordinator, Follower, OneNode


class Supervised(Protocol):
    cfg: EngineConfig
    ranks: list[int]  # global rank of each local process
    procs: list[mp.Process]
    info: dict[int, dict]  # rank -> its ready report
    lost: set[int]  # ranks that left their generation of the ring
    rendezvous: Rendezvous | None
    store: object  # the nodes' rendezvous store (a torch.distributed Store)
    nodes: OneNode | Coordinator | Follower | None  # this node's part in a recovery
    ready_at: dict[int, float]  # rank -> when it reported ready (monotonic)
    beats: dict[int, dict]  # rank -> its latest heartbeat (sent_at, steps, in_step)
    stalled: dict[int, tuple[int, float]]  # rank -> (steps, since) while inside one micro-batch

    def statuses(self, timeout_ms: int = 0) -> list[StageStatus]: ...

    def running(self, rank: int) -> bool: ...

    def exit_cause(self, rank: int) -> str: ...

    def kill(self, rank: int) -> None: ...

    def signal(self, rank: int, sig: int) -> None: ...

    def forget_ready(self) -> None: ...

    def respawn(self, rank: int, generation: int) -> None: ...
