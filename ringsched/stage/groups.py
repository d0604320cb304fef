"""A rank's process groups: the ranks' `torch.distributed` group (none with one rank; it carries the seams, gloo
on CPU and NCCL on GPUs), on NCCL the tokens' way back (a gloo group of rank 0 and the last stage's first
rank) and, with --tp-size or --cp-size > 1, its stage's tensor- or context-parallel group, whose CPU ranks meet in
a shared-memory segment for their collectives.

Why the tokens have a group of their own: on NCCL every operation of a communicator runs in the order it was
posted, on one stream, and a send completes only when its receive runs (past NCCL's eager size). Sharing one
communicator, stage 0 posts `proxy(t + 1)` before it receives `output(t - depth)`, and the last stage posts
`output(t - depth)` before it receives `proxy(t + 1)`: a cycle that held only while NCCL buffered the small token
message. Seams on one communicator and tokens on another, each carries messages one way between two ranks in the
order both sides post them, so no order of posts can form a cycle (`tests/test_seam_cycle.py` runs the loop over a
transport that buffers nothing). The tokens' group is gloo: stage 0 reads them on the host, and the last stage
copies them to pinned memory as the step ends (`stage/outputs.py`), so they never cross NCCL. On CPU the seams'
group is gloo already, whose two directions between a pair are independent queues (a send waits for its receive,
but never behind a receive the same rank posted): the tokens share it there, and a second group would only add
its I/O threads to two busy stages (its PP=2 decode steps ran ~25% slower on a 2-vCPU host)."""

from __future__ import annotations

import datetime
import os
from typing import NamedTuple

import torch
from torch.distributed import PrefixStore

from ringsched.comm.cp_group import CPGroup
from ringsched.comm.shm_group import SHM_DIR, ShmCollectives, shm_usable
from ringsched.comm.store import connect_store, interface_of
from ringsched.config import EngineConfig
from ringsched.layout.rank import RankInfo
from ringsched.models.tp import TPGroup
from ringsched.stage import rejoin
from ringsched.stage.nccl import nccl_setup
from ringsched.weights.tp_shard import TPShard


class RankGroups(NamedTuple):
    store: object  # the store node 0's launcher hosts (None with one rank)
    tp: TPGroup | None
    cp: CPGroup | None
    back: object  # the tokens' way back on NCCL (None: the ranks' group, on gloo; unused with one stage)


def process_groups(cfg: EngineConfig, where: RankInfo, generation: int = 0) -> RankGroups:
    """Join the ranks' process group (none with one rank) of generation `generation` of the ring, the tokens'
    group and, with --tp-size or --cp-size > 1, this stage's tensor- or context-parallel group."""
    if cfg.world_size == 1:
        return RankGroups(None, None, None, None)
    if cfg.nnodes > 1:  # gloo and NCCL pick their interface by name: the one carrying our address
        iface = interface_of(cfg.host_ip)
        if iface:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", iface)
            os.environ.setdefault("NCCL_SOCKET_IFNAME", iface)
    store = connect_store(cfg, is_master=False)
    timeout = datetime.timedelta(seconds=cfg.stage_timeout)
    pg_store = PrefixStore("pg" if generation == 0 else f"pg{generation}", store)
    nccl_setup(cfg, where)
    torch.distributed.init_process_group(
        cfg.backend, store=pg_store, rank=where.rank, world_size=cfg.world_size, timeout=timeout
    )
    back = back_group(cfg, timeout)
    if cfg.ranks_per_stage == 1:
        return RankGroups(store, None, None, back)
    group = None
    for pp in range(cfg.pp_size):  # every rank creates every stage's group, in the same order
        ranks = [cfg.layout.rank_of(pp, t, c) for c in range(cfg.cp_size) for t in range(cfg.tp_size)]
        g = torch.distributed.new_group(ranks, timeout=timeout, backend=cfg.backend)
        if pp == where.pp:
            group = g
    if cfg.cp_size > 1:  # (--cp-size and --tp-size are not combined: the stage's group is its CP group)
        shm = shared_memory(cfg, where, group, where.cp, cfg.cp_size, generation)
        return RankGroups(store, None, CPGroup(where.cp, where.cp_group, group, shm), back)
    shm = shared_memory(cfg, where, group, where.tp, cfg.tp_size, generation)
    return RankGroups(store, TPGroup(TPShard(where.tp, cfg.tp_size), group, shm), None, back)


def back_group(cfg: EngineConfig, timeout: datetime.timedelta):
    """The tokens' way back on NCCL: rank 0 and the last stage's first rank, over gloo (every rank makes it, in the
    same order; the others get a non-member handle). None with one stage, or on gloo (the ranks' group then)."""
    if cfg.pp_size == 1 or cfg.backend != "nccl":
        return None
    last = cfg.layout.rank_of(cfg.pp_size - 1, 0, 0)
    return torch.distributed.new_group([0, last], timeout=timeout, backend="gloo")


def shared_memory(
    cfg: EngineConfig, where: RankInfo, group, index: int, size: int, generation: int = 0
) -> ShmCollectives | None:
    """CPU ranks of a stage (always on one node) meet in a shared segment for their collectives: the stage's
    first rank creates it, all map it, then it is unlinked (so nothing is left behind, even after a SIGKILL).
    `index` of `size`: this rank's place in the stage's group."""
    if not shm_usable(torch.device(cfg.resolved_device)):
        return None
    path = os.path.join(SHM_DIR, f"{os.path.basename(cfg.ipc_dir) or os.getppid()}-stage{where.pp}-g{generation}")
    if where.leads_stage:
        ShmCollectives.create(path, size)
    torch.distributed.barrier(group=group)
    shm = ShmCollectives(path, index, size, cfg.stage_timeout, abort=rejoin.check)
    torch.distributed.barrier(group=group)
    if where.leads_stage:
        os.unlink(path)
    return shm
