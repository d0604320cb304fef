"""Replacing a failed rank of this node (`--max-restarts`).

When a rank dies, reports an error, or is declared hung or stuck, the `Supervisor` hands the failed ranks to
`Recovery.start` instead of stopping the engine, as long as fewer than `--max-restarts` replacements happened within
`--restart-window`. A thread then, in order: kills what is left of each failed rank; sends SIGUSR1 to every other
rank and waits until each has left its generation of the ring (`lost`; one that dies or says nothing within
`--heartbeat-timeout` is replaced too); starts a new process for each failed rank's coordinates, which loads
only its own layers; publishes the next generation in the store (the survivors join it with their weights and
pools as they are, `stage/rejoin.py`); and waits until every rank is ready again. A failure during a recovery
starts the next one over the same steps (it counts as another restart). The front end sees `generation` move on
and replays its open requests (`replay_open`); `/health` is 503 meanwhile, since a rank is missing. Across
nodes, every node's supervisor runs the same pass over its own ranks, node 0's deciding (`process/ring_nodes.py`).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

from ringsched.comm.messages import StageStatus
from ringsched.process.ring_nodes import READY_TIMEOUT_S, NodesFailed
from ringsched.process.supervised import Supervised
from ringsched.stage import rejoin

logger = logging.getLogger("ringsched.launch")

FRONT_PAUSE_S = 5.0  # at most this long for the front end to stop sending (it checks every 0.25 s, or each poll)


class RecoveryFailed(RuntimeError):
    pass


class Recovery:
    def __init__(self, sup: Supervised) -> None:
        self.sup, self.cfg = sup, sup.cfg
        self.generation = 0  # of the ring; moves on when a recovery has every rank ready again
        self.replaced: dict[int, int] = {}  # rank -> times replaced (`ringsched:rank_restarts_total`)
        self.pauses: list[float] = []  # seconds from a failure seen to every rank ready, per recovery
        self.starts: list[float] = []  # of those, seconds from the replacements' start to every rank ready
        self.error: str | None = None  # why a recovery gave up: the engine's failure
        self._times: list[float] = []  # when each replacement happened (for --restart-window)
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._finished = threading.Event()  # a recovery ended well and `done` has not said so yet
        # The front end has stopped sending to stage 0 (`replay.FollowRecovery`): the next generation waits for it,
        # so nothing sent to the failed ring reaches the new one beside its replay.
        self.front_paused = threading.Event()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def done(self) -> bool:
        """True once after each recovery that made the ring whole."""
        finished = self._finished.is_set()
        self._finished.clear()
        return finished

    def allowed(self, more: int = 1) -> bool:
        """Whether `more` replacements (beside those counted) fit --max-restarts within --restart-window."""
        now = time.monotonic()
        recent = [t for t in self._times if now - t < self.cfg.restart_window]
        return self.cfg.restarts_enabled and len(recent) + more <= self.cfg.max_restarts

    def start(self, failed: dict[int, str]) -> None:
        """Replace the ranks `failed` names (rank -> cause), in a thread; `running` until every rank is ready."""
        self.front_paused.clear()
        self._thread = threading.Thread(target=self._run, args=(dict(failed),), name="recovery", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(10.0)

    def _run(self, failed: dict[int, str]) -> None:
        started = time.monotonic()
        try:
            while True:
                self._count(failed)
                failed = self._replace(failed)
                if not failed:
                    break
                if not self.allowed(len(failed)):
                    raise RecoveryFailed(self._beyond(failed))
            self.pauses.append(time.monotonic() - started)
            logger.warning(
                "the ring is whole again (generation %d) after %.1fs, %.1fs of it the replacements' start",
                self.generation,
                self.pauses[-1],
                self.starts[-1],
            )
            self._finished.set()
        except (RecoveryFailed, NodesFailed) as e:
            self.error = str(e)
        except Exception as e:  # noqa: BLE001 (whatever broke the recovery stops the engine, named)
            self.error = f"replacing a failed rank failed: {type(e).__name__}: {e}"

    def _count(self, failed: dict[int, str]) -> None:
        for rank, cause in failed.items():
            self._times.append(time.monotonic())
            self.replaced[rank] = self.replaced.get(rank, 0) + 1
            logger.warning(
                "%s failed: %s; replacing it (restart %d of --max-restarts %d within %gs)",
                self.cfg.describe_rank(rank),
                cause.splitlines()[0],
                len(self._times),
                self.cfg.max_restarts,
                self.cfg.restart_window,
            )

    def _beyond(self, failed: dict[int, str]) -> str:
        rank, cause = next(iter(failed.items()))
        return (
            f"{self.cfg.describe_rank(rank)} failed during a recovery: {cause.splitlines()[0]}; beyond "
            f"--max-restarts {self.cfg.max_restarts} within {self.cfg.restart_window:g}s"
        )

    def _replace(self, failed: dict[int, str]) -> dict[int, str]:
        """One pass, on every node at once (`process/ring_nodes.py`): the failed ranks gone, the survivors out of
        the ring, replacements started, the next generation published; then every rank ready (returns {}) or the
        ranks that failed meanwhile."""
        sup, nodes = self.sup, self.sup.nodes
        generation = nodes.begin(self.generation + 1)
        for rank in failed:
            sup.kill(rank)
        survivors = [r for r in sup.ranks if r not in failed]
        for rank in survivors:
            sup.signal(rank, signal.SIGUSR1)
        newly = self._wait_lost(survivors, set(failed))
        if newly:
            self._count(newly)
            if not self.allowed(0):
                raise RecoveryFailed(self._beyond(newly))
            failed = failed | newly
        for rank in failed:
            sup.kill(rank)
        self._count_remote(*nodes.left(generation, failed))
        self.generation = generation
        sup.forget_ready()
        if sup.cfg.node_rank == 0:
            self.front_paused.wait(FRONT_PAUSE_S)
        spawned = time.monotonic()
        for rank in failed:
            sup.respawn(rank, self.generation)
        nodes.publish(generation)
        failed = self._wait_ready()
        failed |= nodes.ready(generation, failed)
        self.starts.append(time.monotonic() - spawned)
        return failed

    def _count_remote(self, failed: dict[int, str], restarts: int) -> None:
        """Node 0 counts the other nodes' replacements too (a node started again counts once)."""
        self._times.extend([time.monotonic()] * restarts)
        for rank, cause in failed.items():
            self.replaced[rank] = self.replaced.get(rank, 0) + 1
            logger.warning(
                "%s failed: %s; its node replaces it (restart %d of --max-restarts %d within %gs)",
                self.cfg.describe_rank(rank),
                cause.splitlines()[0],
                len(self._times),
                self.cfg.max_restarts,
                self.cfg.restart_window,
            )
        if restarts and not self.allowed(0):
            raise RecoveryFailed(self._beyond(failed))

    def join_running(self, spawn) -> None:
        """A node started again while its ring runs (its launcher had gone): ask node 0 for a pass, start every
        rank of this node in the generation it builds (`spawn(generation)`), and say so; the caller then waits
        for them and calls `joined`."""
        nodes = self.sup.nodes
        generation = nodes.begin(int(self.sup.store.add(rejoin.GENERATION_KEY, 0)) + 1)
        logger.warning("node %d rejoins the running ring in its generation %d", self.cfg.node_rank, generation)
        spawn(generation)
        cause = f"node {self.cfg.node_rank}'s launcher was started again"
        nodes.left(generation, {r: cause for r in self.sup.ranks}, restart=True)
        self.generation = generation

    def joined(self) -> None:
        self.sup.nodes.ready(self.generation, {})

    def _wait_lost(self, survivors: list[int], failed: set[int]) -> dict[int, str]:
        """Until every survivor has left its generation: those that died, failed or said nothing in time."""
        sup, newly = self.sup, {}
        pending = set(survivors) - sup.lost
        deadline = time.monotonic() + max(self.cfg.heartbeat_timeout, 5.0)
        while pending and time.monotonic() < deadline and not self._stopping.is_set():
            for m in sup.statuses(200):
                if m.state == "lost":
                    pending.discard(m.rank)
                elif m.state == "error" and m.rank not in failed:
                    newly[m.rank] = m.error or "unknown error"
                    pending.discard(m.rank)
            for rank in list(pending):
                if not sup.running(rank):
                    newly[rank] = sup.exit_cause(rank)
                    pending.discard(rank)
        for rank in pending:
            newly[rank] = f"did not leave the ring within {max(self.cfg.heartbeat_timeout, 5.0):g}s"
        return newly

    def _wait_ready(self) -> dict[int, str]:
        sup, deadline = self.sup, time.monotonic() + READY_TIMEOUT_S
        while len(sup.info) < len(sup.ranks):
            if self._stopping.is_set():
                raise RecoveryFailed("the engine is stopping")
            if time.monotonic() > deadline:
                raise RecoveryFailed(f"no replacement ready after {READY_TIMEOUT_S:.0f}s")
            failed = {}
            for m in sup.statuses(200):
                if m.state in ("error", "lost") and m.rank not in failed:
                    failed[m.rank] = m.error or m.state
            failed |= {r: sup.exit_cause(r) for r in sup.ranks if not sup.running(r)}
            if failed:
                return failed
        return {}


def note_status(sup: Supervised, m: StageStatus) -> None:
    """A `lost` report reaching the supervisor before it knew of any failure: remembered, so a recovery does not
    wait for it again."""
    if m.state == "lost":
        sup.lost.add(m.rank)
    elif m.state == "ready":
        sup.lost.discard(m.rank)


def pid_signal(pid: int | None, sig: int) -> None:
    if pid is None:
        return
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
