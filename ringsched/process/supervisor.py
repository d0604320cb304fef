"""Start the stage processes of this node, wait until each is ready, watch them, stop them.

Used by the offline `Engine` and by the launcher. Stages are spawned (not forked), shown as `ringsched-ppK`
by `ps` and `pgrep`, and report over a ZMQ status channel, a heartbeat among the rest. `check()` raises
`StageFailure` naming the stage and its cause when a stage dies or reports an error, when its heartbeats stop
for `--heartbeat-timeout` (hung: stopped, or stuck holding the GIL), or when its loop makes no progress for
`--stage-timeout` while inside a micro-batch (stuck); `stop()` always leaves no child behind (shutdown
message, then kill; straight to kill once a failure is known).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import shutil
import time
from dataclasses import replace

import zmq

from ringsched.comm.messages import Shutdown, StageStatus
from ringsched.comm.zmq_io import Puller, Pusher, ipc_addr, new_ipc_dir
from ringsched.config import EngineConfig
from ringsched.layout.rank import node_rank_infos
from ringsched.process.diagnosis import describe, liveness, remote_cause
from ringsched.process.node_partition import own_partition
from ringsched.process.ports import free_port
from ringsched.process.ready_log import log_ready
from ringsched.process.recovery import Recovery, note_status, pid_signal
from ringsched.process.rendezvous import Rendezvous, meet
from ringsched.process.ring_nodes import mark_started, nodes_for, ring_started
from ringsched.process.spawn import stop_resource_tracker, without_main_module
from ringsched.spec import ModelSpec
from ringsched.stage.channels import StageAddrs
from ringsched.stage.heap import stage_allocator_env
from ringsched.stage.worker import process_name, stage_main

logger = logging.getLogger("ringsched.launch")


class StageFailure(RuntimeError):
    pass


class Supervisor:
    def __init__(self, cfg: EngineConfig, spec: ModelSpec) -> None:
        ipc_dir = cfg.ipc_dir or new_ipc_dir()
        if cfg.dist_init_addr is None:
            cfg = replace(cfg, dist_init_addr=f"127.0.0.1:{free_port()}")
        self.cfg, self.spec, self.ipc_dir = replace(cfg, ipc_dir=ipc_dir), spec, ipc_dir
        self.addrs = StageAddrs(
            ctl=ipc_addr(ipc_dir, "ctl"),
            front_in=ipc_addr(ipc_dir, "front-in"),
            front_out=ipc_addr(ipc_dir, "front-out"),
            # One node: every plan channel is a local ipc socket. Several: tcp, exchanged through the store.
            plans=tuple(ipc_addr(ipc_dir, f"plan-{k}") for k in range(cfg.pp_size)) if cfg.nnodes == 1 else (),
            progress=ipc_addr(ipc_dir, "progress") if cfg.nnodes == 1 else "",
            group_plans=tuple(ipc_addr(ipc_dir, f"group-plan-{r}") for r in range(cfg.world_size))
            if cfg.ranks_per_stage > 1
            else (),
        )
        self.ctx = zmq.Context()
        self.ctl = Puller(self.ctx, self.addrs.ctl)
        self.procs: list[mp.Process] = []
        self.ranks: list[int] = []  # global rank of each local process
        self.rendezvous: Rendezvous | None = None
        self.info: dict[int, dict] = {}
        self.stats: dict[int, dict] = {}
        self.failure: str | None = None
        self.ready_at: dict[int, float] = {}
        self.beats: dict[int, dict] = {}  # rank -> its latest heartbeat (sent_at, steps, in_step)
        self.stalled: dict[int, tuple[int, float]] = {}  # rank -> (steps, since) while inside one micro-batch
        self.nodes = None  # this node's part in a recovery (`process/ring_nodes.py`), once the store is there
        self.lost: set[int] = set()  # ranks that left their generation of the ring (`stage/rejoin.py`)
        self.recovery = Recovery(self)
        # The ring has been whole once: before that a failure is the start's (a configuration or a load error a
        # replacement would meet again), so it stops the engine at once instead of being replaced
        self.started = False

    def start(self, timeout: float = 600.0) -> None:
        """Meet the other nodes, spawn this node's stages, wait until each is ready."""
        try:
            self.rendezvous, self.cfg, self.spec = meet(self.cfg, self.spec, own_partition(self.cfg, self.spec))
        except BaseException:
            self.stop()
            raise
        self.nodes = nodes_for(self.cfg, self.store, lambda: self.rendezvous.stopped, self.rendezvous.last_seen)
        if self.cfg.node_rank > 0 and self.cfg.restarts_enabled and ring_started(self.store):
            self.recovery.join_running(self._spawn)  # this node's launcher had gone: its ring still runs
            self._wait_ready(timeout)
            self.recovery.joined()
        else:
            self._spawn(0)
            self._wait_ready(timeout)
            if self.cfg.node_rank == 0:
                mark_started(self.store)
        self.started = True
        self.rendezvous.start_heartbeat(on_beat=getattr(self.nodes, "watch", None))
        log_ready(self.cfg, self.info, self.spec.context_len)

    def _spawn(self, generation: int) -> None:
        """One process per rank of this node (spawned, not forked), starting in `generation` of the ring."""
        for info in node_rank_infos(self.cfg.layout, self.rendezvous.partition, self.cfg.node_rank):
            self.procs.append(self._start(info, generation))
            self.ranks.append(info.rank)

    def _start(self, info, generation: int) -> mp.Process:
        name = process_name(
            info.pp, info.tp if self.cfg.tp_size > 1 else None, info.cp if self.cfg.cp_size > 1 else None
        )
        p = mp.get_context("spawn").Process(
            target=stage_main, args=(self.cfg, self.spec, info, self.addrs, generation), name=name, daemon=True
        )
        with without_main_module(), stage_allocator_env():
            p.start()
        return p

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while len(self.info) < len(self.ranks):
            if time.monotonic() > deadline:
                self.stop()
                missing = [self.cfg.describe_rank(r) for r in sorted(set(self.ranks) - set(self.info))]
                raise StageFailure(f"{', '.join(missing)} not ready after {timeout:.0f}s")
            try:
                self.check(timeout_ms=200)
            except StageFailure:
                self.stop()
                raise

    def check(self, timeout_ms: int = 0) -> None:
        """Take in status messages; raise `StageFailure` if a stage reported an error or died (or, with
        --max-restarts, once replacing it is beyond the limit or failed). While a recovery runs, it reads them."""
        if self.recovery.running:
            time.sleep(timeout_ms / 1000)
            if self.cfg.node_rank > 0 and self.rendezvous is not None and self.rendezvous.check():
                self.failure = self.rendezvous.failure  # node 0 out of reach past --rejoin-timeout: give up
                raise StageFailure(self.failure)
            return
        if self.failure is None and self.recovery.error:
            self.failure = self.recovery.error
        elif self.recovery.done() and self.rendezvous is not None:
            self.rendezvous.forgive()  # a node silent while the ring was rebuilt is not silent now
        if self.failure is None:
            errors = self._take_status(self.statuses(timeout_ms))
            dead = [(r, p) for r, p in zip(self.ranks, self.procs, strict=True) if p.exitcode is not None]
            if errors or dead or self.lost:
                # One failure brings down its neighbours (their connections close): wait a moment for every
                # report, then name the root cause, a stage that died without saying why, first.
                time.sleep(0.3)
                errors.update(self._take_status(self.statuses()))
                dead = [(r, p) for r, p in zip(self.ranks, self.procs, strict=True) if p.exitcode is not None]
                failed = {r: self.exit_cause(r) for r, _ in dead} | errors
                if self._recover(failed):
                    return
                self.failure = remote_cause(self, errors, dead) + describe(self, errors, dead)
            elif self.rendezvous is not None and self.rendezvous.check():
                if self._recover_node():
                    return
                self.failure = self.rendezvous.failure
            elif self.nodes is not None and self.nodes.pending(self.generation) and self._recover({}):
                return
            elif (hung := liveness(self)) is not None:
                if self._recover({hung[0]: hung[1]}):
                    return
                self.failure = hung[1]
            if self.failure and self.rendezvous is not None:
                self.rendezvous.publish_failure(self.failure)
        if self.failure:
            raise StageFailure(self.failure)

    def _recover_node(self) -> bool:
        """Node 0, a node silent: a recovery waits for it to be started again (--rejoin-timeout)."""
        if self.cfg.node_rank != 0 or self.rendezvous.stopped is not None or not self._recover({}):
            return False
        logger.warning(
            "%s; waiting up to --rejoin-timeout %gs for it to come back (its link restored, or its launcher "
            "started again)",
            self.rendezvous.failure,
            self.cfg.rejoin_timeout,
        )
        self.rendezvous.forgive()
        return True

    def _recover(self, failed: dict[int, str]) -> bool:
        """Hand `failed` (rank -> cause) to a recovery, if one is allowed (not while the engine starts)."""
        if not self.started or not self.recovery.allowed(max(len(failed), 1)):
            return False
        self.recovery.start(failed)
        return True

    def statuses(self, timeout_ms: int = 0) -> list[StageStatus]:
        """The status messages waiting (for up to `timeout_ms` when none is), with ready/heartbeat/stats/lost
        taken in."""
        msg = self.ctl.recv(timeout_ms) if timeout_ms else None
        msgs = ([msg] if msg else []) + self.ctl.drain()
        self._take_status(msgs)
        return msgs

    def _take_status(self, msgs: list) -> dict[int, str]:
        errors = {}
        for m in msgs:
            assert isinstance(m, StageStatus)
            note_status(self, m)
            if m.state == "ready":
                self.info[m.rank] = m.info
                self.ready_at[m.rank] = time.monotonic()
            elif m.state == "heartbeat":
                self.beats[m.rank] = m.info
            elif m.state == "stats":
                self.stats[m.rank] = m.info
            elif m.state == "error":
                errors[m.rank] = m.error or "unknown error"
        return errors

    # What a recovery (`process/recovery.py`) does to this node's ranks.

    def _proc(self, rank: int) -> mp.Process:
        return self.procs[self.ranks.index(rank)]

    def running(self, rank: int) -> bool:
        return self._proc(rank).exitcode is None

    def exit_cause(self, rank: int) -> str:
        p = self._proc(rank)
        how = f"was killed by signal {-p.exitcode}" if (p.exitcode or 0) < 0 else f"exited with code {p.exitcode}"
        return f"{self.cfg.describe_rank(rank)} (pid {p.pid}) {how}"

    def kill(self, rank: int) -> None:
        p = self._proc(rank)
        if p.exitcode is None:
            p.kill()
        p.join(5.0)

    def signal(self, rank: int, sig: int) -> None:
        pid_signal(self._proc(rank).pid, sig)

    def forget_ready(self) -> None:
        self.info, self.ready_at, self.beats, self.stalled = {}, {}, {}, {}
        self.lost.clear()

    def respawn(self, rank: int, generation: int) -> None:
        """A new process for `rank`'s coordinates, starting in `generation` of the ring."""
        info = next(
            i for i in node_rank_infos(self.cfg.layout, self.rendezvous.partition, self.cfg.node_rank) if i.rank == rank
        )
        self.procs[self.ranks.index(rank)] = self._start(info, generation)

    @property
    def store(self):
        return self.rendezvous.store

    @property
    def generation(self) -> int:
        return self.recovery.generation

    @property
    def alive(self) -> bool:
        """No failure, every rank running, none being replaced (`/health`)."""
        return self.failure is None and not self.recovery.running and all(p.exitcode is None for p in self.procs)

    @property
    def local_ranks(self) -> list[int]:
        return list(self.ranks)

    def stop(self, grace: float = 5.0) -> None:
        """Ask stage 0 to stop the ring, then make sure every child is gone."""
        self.recovery.stop()
        if self.rendezvous is not None:
            self.rendezvous.announce_stop(self.failure or "")
            self.rendezvous.close()
        if self.cfg.node_rank == 0 and any(p.exitcode is None for p in self.procs):
            try:
                push = Pusher(self.ctx, self.addrs.front_in)
                push.send(Shutdown("stop"))
                push.close()
            except zmq.ZMQError:
                pass
        if self.failure:  # a failed ring may not read the Shutdown (a stage is gone, hung or blocked on one)
            grace = min(grace, 1.0)
        deadline = time.monotonic() + grace
        for p in self.procs:
            p.join(max(deadline - time.monotonic(), 0.05))
        for p in self.procs:
            if p.exitcode is None:  # stages ignore SIGTERM (it is the launcher's to handle): kill
                logger.warning("%s did not stop within %.0fs; killing it", p.name, grace)
                p.kill()
        for p in self.procs:
            p.join(2.0)
        self.ctl.close()
        self.ctx.destroy(linger=0)
        shutil.rmtree(self.ipc_dir, ignore_errors=True)
        if self.procs:
            stop_resource_tracker()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p.pid is not None] + [os.getpid()]
