"""A rank's process groups: the ranks' `torch.distributed` group (none with one rank) and, with --tp-size or
--cp-size > 1, its stage's tensor- or context-parallel group, whose CPU ranks meet in a shared-memory segment for
their collectives."""

from __future__ import annotations

import datetime
import os

import torch
from torch.distributed import PrefixStore

from ringsched.comm.cp_group import CPGroup
from ringsched.comm.shm_group import SHM_DIR, ShmCollectives, shm_usable
from ringsched.comm.store import connect_store, interface_of
from ringsched.config import EngineConfig
from ringsched.layout.rank import RankInfo
from ringsched.models.tp import TPGroup
from ringsched.stage import rejoin
from ringsched.weights.tp_shard import TPShard


def process_groups(cfg: EngineConfig, where: RankInfo, generation: int = 0) -> tuple:
    """Join the ranks' process group (none with one rank) of generation `generation` of the ring and, with
    --tp-size or --cp-size > 1, this stage's tensor- or context-parallel group: the store node 0's launcher hosts
    (or None), this rank's `TPGroup` (or None) and its `CPGroup` (or None)."""
    if cfg.world_size == 1:
        return None, None, None
    if cfg.nnodes > 1:  # gloo and NCCL pick their interface by name: the one carrying our address
        iface = interface_of(cfg.host_ip)
        if iface:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", iface)
            os.environ.setdefault("NCCL_SOCKET_IFNAME", iface)
    store = connect_store(cfg, is_master=False)
    timeout = datetime.timedelta(seconds=cfg.stage_timeout)
    pg_store = PrefixStore("pg" if generation == 0 else f"pg{generation}", store)
    torch.distributed.init_process_group(
        cfg.backend, store=pg_store, rank=where.rank, world_size=cfg.world_size, timeout=timeout
    )
    if cfg.ranks_per_stage == 1:
        return store, None, None
    group = None
    for pp in range(cfg.pp_size):  # every rank creates every stage's group, in the same order
        ranks = [cfg.layout.rank_of(pp, t, c) for c in range(cfg.cp_size) for t in range(cfg.tp_size)]
        g = torch.distributed.new_group(ranks, timeout=timeout, backend=cfg.backend)
        if pp == where.pp:
            group = g
    if cfg.cp_size > 1:  # (--cp-size and --tp-size are not combined: the stage's group is its CP group)
        shm = shared_memory(cfg, where, group, where.cp, cfg.cp_size, generation)
        return store, None, CPGroup(where.cp, where.cp_group, group, shm)
    shm = shared_memory(cfg, where, group, where.tp, cfg.tp_size, generation)
    return store, TPGroup(TPShard(where.tp, cfg.tp_size), group, shm), None


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
