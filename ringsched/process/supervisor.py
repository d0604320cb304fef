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
import socket
import time
from dataclasses import replace

import torch
import zmq

from ringsched.comm.messages import Shutdown, StageStatus
from ringsched.comm.tensor_channel import without_source_paths
from ringsched.comm.zmq_io import Puller, Pusher, ipc_addr, new_ipc_dir
from ringsched.config import EngineConfig
from ringsched.layout.partition import head_layers, log_partition, partition_source
from ringsched.layout.rank import node_rank_infos
from ringsched.process.partition_auto import BatchShape, choose_partition, choose_partition_apart
from ringsched.process.rendezvous import Rendezvous
from ringsched.process.spawn import stop_resource_tracker, without_main_module
from ringsched.spec import ModelSpec
from ringsched.stage.affinity import cpu_list, stage_cpus
from ringsched.stage.heap import stage_allocator_env
from ringsched.stage.worker import StageAddrs, process_name, stage_main

logger = logging.getLogger("ringsched.launch")


class StageFailure(RuntimeError):
    pass


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


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
            if cfg.ranks_per_stage > 1 else (),
        )
        self.ctx = zmq.Context()
        self.ctl = Puller(self.ctx, self.addrs.ctl)
        self.procs: list[mp.Process] = []
        self.ranks: list[int] = []  # global rank of each local process
        self.rendezvous: Rendezvous | None = None
        self.info: dict[int, dict] = {}
        self.stats: dict[int, dict] = {}
        self.failure: str | None = None
        self._ready_at: dict[int, float] = {}
        self._beats: dict[int, dict] = {}  # rank -> its latest heartbeat (sent_at, steps, in_step)
        self._stalled: dict[int, tuple[int, float]] = {}  # rank -> (steps, since) while inside one micro-batch

    def start(self, timeout: float = 600.0) -> None:
        """Meet the other nodes, spawn this node's stages, wait until each is ready."""
        partition = self._own_partition()
        given, auto = self.cfg.pp_layer_partition, self.cfg.auto_partition  # before the stages are told the split
        try:
            self.rendezvous = Rendezvous(self.cfg, self.cfg.model, self.spec.model_dir, partition)
            self.rendezvous.join()
            # The stages (and this node, when it left `auto` to node 0) take the partition node 0 runs.
            decided = ",".join(map(str, self.rendezvous.partition))
            self.cfg = replace(self.cfg, host_ip=self.rendezvous.host_ip, pp_layer_partition=decided)
            self.cfg.check_partition(sum(self.rendezvous.partition))  # `auto` may leave no room for the flex
            self.spec = self.spec.with_partition(self.rendezvous.partition)
        except BaseException:
            self.stop()
            raise
        if self.cfg.node_rank == 0:
            # `auto` logged its measured costs; otherwise the head is weighed as the default split weighs it.
            head = 0.0 if auto else head_layers(self.spec.config)
            log_partition(self.rendezvous.partition, partition_source(given), head)
        if self.cfg.nnodes > 1:
            logger.info(
                "node %d of %d joined the rendezvous at %s as %s; ranks %s run here",
                self.cfg.node_rank, self.cfg.nnodes, self.cfg.dist_init_addr, self.cfg.host_ip,
                list(self.cfg.local_ranks),
            )  # fmt: skip
        self._spawn()
        self._wait_ready(timeout)
        self.rendezvous.start_heartbeat()
        for rank in sorted(self.info):
            i = self.info[rank]
            logger.info(
                "%s ready: layers %d-%d, weights %.1f MiB, KV %d tokens, %d thread(s) on CPUs %s (pid %d)",
                self.cfg.describe_rank(rank), i["layers"][0], i["layers"][1] - 1, i["weights_bytes"] / 2**20,
                i["kv_tokens"], i["threads"], cpu_list(i["cpus"]), i["pid"],
            )  # fmt: skip

    def _spawn(self) -> None:
        """One process per rank of this node (spawned, not forked)."""
        spawn = mp.get_context("spawn")
        for info in node_rank_infos(self.cfg.layout, self.rendezvous.partition, self.cfg.node_rank):
            name = process_name(info.pp, info.tp if self.cfg.tp_size > 1 else None,
                                info.cp if self.cfg.cp_size > 1 else None)
            p = spawn.Process(
                target=stage_main, args=(self.cfg, self.spec, info, self.addrs), name=name, daemon=True
            )
            with without_main_module(), stage_allocator_env():
                p.start()
            self.procs.append(p)
            self.ranks.append(info.rank)

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

    def _own_partition(self) -> list[int] | None:
        """This node's partition: the override or default, or for `auto` node 0's measured choice (other nodes
        return None and take node 0's from the rendezvous)."""
        mcfg = self.spec.config
        if not self.cfg.auto_partition:
            return self.cfg.partition(mcfg.num_layers, head_layers(mcfg))
        if self.cfg.node_rank != 0:
            return None
        c = self.cfg
        shape = BatchShape.for_workload(
            c.micro_batch_size, c.chunked_prefill_size, c.context_len(mcfg.max_position_embeddings),
            c.pp_auto_input_len, c.pp_auto_output_len,
        )  # fmt: skip
        device = torch.device("cuda", 0) if c.resolved_device == "cuda" else torch.device("cpu")
        # Node 0 knows only its own cores: with several nodes, its first stage's stand in for every stage's.
        here = [stage_cpus(c.threads, c.ranks_per_node, i * c.ranks_per_stage, c.resolved_device)
                for i in range(c.stages_per_node)]  # fmt: skip
        cpus = here if c.nnodes == 1 else [here[0]] * c.pp_size
        choose = choose_partition_apart if device.type == "cuda" else choose_partition  # no CUDA context here
        counts, _ = choose(mcfg, c.pp_size, shape, c.torch_dtype, device, c.threads, cpus,
                           attention_backend=c.attention_backend)
        return counts

    def check(self, timeout_ms: int = 0) -> None:
        """Take in status messages; raise `StageFailure` if a stage reported an error or died."""
        if self.failure is None:
            msg = self.ctl.recv(timeout_ms) if timeout_ms else None
            errors = self._take_status(([msg] if msg else []) + self.ctl.drain())
            dead = [(r, p) for r, p in zip(self.ranks, self.procs, strict=True) if p.exitcode is not None]
            if errors or dead:
                # One failure brings down its neighbours (their connections close): wait a moment for every
                # report, then name the root cause, a stage that died without saying why, first.
                time.sleep(0.3)
                errors.update(self._take_status(self.ctl.drain()))
                dead = [(r, p) for r, p in zip(self.ranks, self.procs, strict=True) if p.exitcode is not None]
                self.failure = self._remote_cause(errors, dead) + self._describe(errors, dead)
            elif self.rendezvous is not None and self.rendezvous.check():
                self.failure = self.rendezvous.failure
            else:
                self.failure = self._liveness()
            if self.failure and self.rendezvous is not None:
                self.rendezvous.publish_failure(self.failure)
        if self.failure:
            raise StageFailure(self.failure)

    def _remote_cause(self, errors: dict[int, str], dead: list) -> str:
        """When every rank here only lost a neighbour on another node, that node's own account (which of its
        ranks died, and how) comes first: `"node 1: rank 3 (...) was killed by signal 9; then here: "`."""
        if self.rendezvous is None or self.cfg.nnodes == 1 or any(r not in errors for r, _ in dead):
            return ""  # a rank here died without a word: the cause is here
        if not errors or not all(e.startswith("PeerLost") for e in errors.values()):
            return ""
        remote = self.rendezvous.wait_remote_failure(3.0)
        return f"{remote}; then here: " if remote else ""

    def _take_status(self, msgs: list) -> dict[int, str]:
        errors = {}
        for m in msgs:
            assert isinstance(m, StageStatus)
            if m.state == "ready":
                self.info[m.rank] = m.info
                self._ready_at[m.rank] = time.monotonic()
            elif m.state == "heartbeat":
                self._beats[m.rank] = m.info
            elif m.state == "stats":
                self.stats[m.rank] = m.info
            elif m.state == "error":
                errors[m.rank] = m.error or "unknown error"
        return errors

    def _liveness(self) -> str | None:
        """A ready stage whose heartbeats stopped (hung), or whose loop sat in one micro-batch too long (stuck).
        Heartbeats carry the stage's monotonic clock (one clock per machine), so a supervisor that was slow to
        look does not mistake its own delay for the stage's silence."""
        now, cfg = time.monotonic(), self.cfg
        for rank, p in zip(self.ranks, self.procs, strict=True):
            if rank not in self._ready_at:
                continue  # still loading: start()'s deadline covers it
            beat = self._beats.get(rank)
            silent = now - (beat["sent_at"] if beat else self._ready_at[rank])
            if silent > cfg.heartbeat_timeout:
                return (
                    f"{cfg.describe_rank(rank)} (pid {p.pid}) is hung: no heartbeat for {silent:.1f}s "
                    f"(--heartbeat-timeout {cfg.heartbeat_timeout:g}); it is stopped, or blocked without releasing "
                    "Python's GIL"
                )
            if beat is None or not beat["in_step"]:
                self._stalled.pop(rank, None)
                continue
            steps, since = self._stalled.get(rank, (None, beat["sent_at"]))
            if steps != beat["steps"]:
                self._stalled[rank] = (beat["steps"], beat["sent_at"])
            elif beat["sent_at"] - since > cfg.stage_timeout:
                return (
                    f"{cfg.describe_rank(rank)} (pid {p.pid}) is stuck: one micro-batch has taken "
                    f"{beat['sent_at'] - since:.0f}s without finishing (--stage-timeout {cfg.stage_timeout:g})"
                )
        return None

    def _describe(self, errors: dict[int, str], dead: list[tuple[int, mp.Process]]) -> str:
        """The root cause first: a stage that died without a word, else the first error that is not a stage
        losing its neighbour (which is what the others report once the failed one is gone). `errors` is in the
        order the reports arrived."""
        silent = [(r, p) for r, p in dead if r not in errors]
        if silent:
            r, p = silent[0]
            how = f"was killed by signal {-p.exitcode}" if p.exitcode < 0 else f"exited with code {p.exitcode}"
            msg = f"{self.cfg.describe_rank(r)} (pid {p.pid}) {how} without reporting an error"
            others = [f"{self.cfg.describe_rank(k)}: {without_source_paths(e.splitlines()[0])}"
                      for k, e in errors.items()]  # fmt: skip
            return msg + (f"; then {'; '.join(others)}" if others else "")
        causes = [k for k, e in errors.items() if not e.startswith("PeerLost")] or list(errors)
        r = causes[0]
        first, _, details = errors[r].partition("\n")
        then = [k for k in errors if k != r]
        noun = ("rank" if self.cfg.ranks_per_stage > 1 else "stage") + ("s" if len(then) > 1 else "")
        after = f"; then {noun} {', '.join(map(str, then))} stopped too" if then else ""
        return f"{self.cfg.describe_rank(r)} failed: {without_source_paths(first)}{after}\n{details}"

    @property
    def alive(self) -> bool:
        return self.failure is None and all(p.exitcode is None for p in self.procs)

    @property
    def local_ranks(self) -> list[int]:
        return list(self.ranks)

    def stop(self, grace: float = 5.0) -> None:
        """Ask stage 0 to stop the ring, then make sure every child is gone."""
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
