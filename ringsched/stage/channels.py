"""A rank's stage-to-stage ZMQ channels: plans from stage k to stage k+1 (and from a stage's first rank to its
other ranks), and `--pp-flex-policy ready`'s progress messages from stage 1 to stage 0. On one node they use the
launcher's ipc addresses; across nodes the receiver binds a tcp port and publishes it in the rendezvous store."""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed import PrefixStore

from ringsched.comm.zmq_io import Fanout, Puller, Pusher
from ringsched.config import EngineConfig
from ringsched.layout.rank import RankInfo, StageInfo


@dataclass(frozen=True)
class StageAddrs:
    ctl: str  # stage -> launcher status
    front_in: str  # front end -> stage 0
    front_out: str  # stage 0 -> front end
    plans: tuple[str, ...]  # one node: plans[k] is stage k-1 -> stage k (index 0 unused); several: empty
    progress: str = ""  # one node: stage 1 -> stage 0 (--pp-flex-policy ready); several: empty
    group_plans: tuple[str, ...] = ()  # per global rank: its stage's first rank -> it (--tp-size > 1; local ipc)


def plan_channels(cfg: EngineConfig, where: RankInfo, addrs: StageAddrs, ctx, store) -> tuple:
    """Plans flow from stage k's first rank to stage k+1's, which binds the channel it receives on (see
    `_receiver`); each stage's first rank also passes them to the stage's other ranks (local ipc: a stage sits on
    one node). The plan out is a `Fanout` over both, or None."""
    zstore = PrefixStore("zmq", store) if cfg.nnodes > 1 else None
    ipc = addrs.plans or ("",) * cfg.pp_size  # several nodes: tcp, no ipc addresses
    k = where.pp
    if not where.leads_stage:
        return Puller(ctx, addrs.group_plans[where.rank]), None
    plan_in = None if k == 0 else _receiver(ctx, zstore, cfg.host_ip, ipc[k], f"plan/{k}")
    outs = [] if k == cfg.pp_size - 1 else [_sender(ctx, zstore, ipc[k + 1], f"plan/{k + 1}")]
    outs += [Pusher(ctx, addrs.group_plans[r]) for r in where.stage_group if r != where.rank]
    return plan_in, Fanout(outs) if outs else None


def progress_channels(cfg: EngineConfig, stage: StageInfo, addrs: StageAddrs, ctx, store) -> tuple:
    """`--pp-flex-policy ready`: stage 1 tells stage 0 how far it is with its micro-batch; stage 0 binds."""
    if not (cfg.pp_flex_layers and cfg.pp_flex_policy == "ready"):
        return None, None
    zstore = PrefixStore("zmq", store) if cfg.nnodes > 1 else None
    if stage.is_first:
        return _receiver(ctx, zstore, cfg.host_ip, addrs.progress, "progress"), None
    return None, _sender(ctx, zstore, addrs.progress, "progress")


def _receiver(ctx, zstore, host_ip: str, ipc: str, key: str) -> Puller:
    """The receiving end of a stage-to-stage ZMQ channel binds: on one node (no store) the launcher's `ipc`
    address; across nodes a free tcp port on this node's address, published in the store under `key`."""
    if zstore is None:
        return Puller(ctx, ipc)
    puller = Puller(ctx, f"tcp://{host_ip}:*")
    zstore.set(key, puller.endpoint)
    return puller


def _sender(ctx, zstore, ipc: str, key: str) -> Pusher:
    """The sending end connects: to `ipc` on one node, or to what the receiver published under `key` (the
    store's `get` waits for it, up to the store's timeout)."""
    return Pusher(ctx, ipc if zstore is None else zstore.get(key).decode())


def generation_store(store, generation: int):
    """The store keys of one generation of the ring (`stage/rejoin.py`): the first uses the store as it is, a
    later one its own prefix, so a replacement never reads an endpoint of the process it replaces."""
    return store if store is None or generation == 0 else PrefixStore(f"gen{generation}", store)
