"""One stage process: set up (threads, process group, weights, KV pool, sockets), report ready, run the loop.

Any exception is reported to the launcher as a `StageStatus("error")` with the traceback before the process
exits non-zero, so the launcher can stop the others and say which stage failed and why.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import signal
import threading
import time
import traceback
from dataclasses import dataclass

import torch
import zmq

from ringsched.comm.messages import StageStatus
from ringsched.comm.tensor_channel import TensorChannel
from ringsched.comm.zmq_io import Puller, Pusher
from ringsched.config import EngineConfig, parse_memory
from ringsched.device import activation_reserve, set_matmul_precision
from ringsched.kv.cache import BlockTable, KVPool, blocks_for_memory
from ringsched.kv.cp_blocks import CPBlocks, request_capacity
from ringsched.layout.rank import RankInfo, StageInfo
from ringsched.models import linear_tuning
from ringsched.models.config import ModelConfig
from ringsched.models.loader import load_stage_model, weights_bytes
from ringsched.scheduler import chunking
from ringsched.scheduler.planner import Planner
from ringsched.spec import ModelSpec
from ringsched.stage import chunk_probe
from ringsched.stage.affinity import allowed_cpus, stage_cpus
from ringsched.stage.channels import plan_channels, progress_channels
from ringsched.stage.groups import process_groups
from ringsched.stage.heap import keep_heap
from ringsched.stage.loop import StageIO, StageLoop

logger = logging.getLogger("ringsched.layout.rank")


@dataclass(frozen=True)
class StageAddrs:
    ctl: str  # stage -> launcher status
    front_in: str  # front end -> stage 0
    front_out: str  # stage 0 -> front end
    plans: tuple[str, ...]  # one node: plans[k] is stage k-1 -> stage k (index 0 unused); several: empty
    progress: str = ""  # one node: stage 1 -> stage 0 (--pp-flex-policy ready); several: empty
    group_plans: tuple[str, ...] = ()  # per global rank: its stage's first rank -> it (--tp-size > 1; local ipc)


class ParentGone(RuntimeError):
    pass


def stage_main(cfg: EngineConfig, spec: ModelSpec, where: RankInfo, addrs: StageAddrs) -> None:
    rank = where.rank
    logging.basicConfig(
        level=cfg.log_level.upper(),
        format=f"[{cfg.describe_rank(rank)}] %(asctime)s %(levelname)s %(message)s",
        force=True,
    )
    _set_process_name(process_name(where.pp, where.tp if cfg.tp_size > 1 else None,
                                   where.cp if cfg.cp_size > 1 else None))
    # Ctrl-C in a terminal, and scancel or systemd's SIGTERM, reach the whole process group; the launcher owns
    # shutdown, so a stage ignores them and stops when told to (Shutdown plan), when its parent is gone, or by
    # the launcher's SIGKILL.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ctx = zmq.Context()
    ctl = Pusher(ctx, addrs.ctl)
    try:
        loop, info = _setup(cfg, spec, where, addrs, ctx, ctl)
        _start_heartbeat(ctx, addrs.ctl, rank, loop)
        ctl.send(StageStatus(rank, "ready", info))
        loop.run()
        ctl.send(StageStatus(rank, "exited"))
        logger.info("stopped")
    except BaseException as e:  # report everything, KeyboardInterrupt included
        if not isinstance(e, (KeyboardInterrupt, ParentGone)):
            ctl.send(StageStatus(rank, "error", error=f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
            logger.error("failed: %s", e)
        ctl.close()
        ctx.destroy(linger=1000)
        os._exit(1)
    ctl.close()
    ctx.destroy(linger=1000)
    os._exit(0)  # skip interpreter teardown: a peer's pending gloo work must not hang our exit


def _setup(cfg, spec: ModelSpec, where: RankInfo, addrs, ctx, ctl) -> tuple[StageLoop, dict]:
    """Threads and device, the process group, this stage's weights and KV pool, its sockets: its loop, and what
    it reports as ready."""
    rank = where.rank
    parent = os.getppid()

    def alive() -> None:
        if os.getppid() != parent:
            raise ParentGone("the launcher is gone")

    device = _threads_and_device(cfg, where.local_rank)
    store, tp, cp = process_groups(cfg, where)
    mcfg, counts = spec.config, list(spec.partition)
    flex = cfg.flex_boundary(mcfg.num_layers, counts)
    stage = where.stage  # with a flexible cut, the stage also holds the shared layers around the cut
    if flex:
        held = flex.held(where.pp)
        stage = dataclasses.replace(stage, start_layer=held[0], end_layer=held[1])
        if where.decides:
            logger.info("flexible cut: stage 0 runs the first %d to %d layers of each micro-batch", flex.lo, flex.hi)
    model = load_stage_model(spec.model_dir, stage, cfg.torch_dtype, device, tp=tp, quantization=cfg.quantization)
    linear_tuning.tune_stage(model, cfg.linear_tuning, cfg.torch_dtype)  # its threads and weights: after both
    local = tp.shard.local_config(mcfg) if tp else mcfg  # this rank's KV heads
    num_blocks = _kv_blocks(cfg, local, stage, device)
    pool = KVPool(local, stage.num_layers, num_blocks, cfg.block_size, cfg.torch_dtype, device)
    blocks = BlockTable(num_blocks, cfg.block_size, follower=not where.decides,
                        prefix_caching=cfg.enable_prefix_caching)  # fmt: skip
    info = _ready_info(cfg, where, stage, counts[stage.rank], model, pool, blocks)
    planner = None
    if where.decides:
        planner = _planner(cfg, spec, local, blocks, device, cp=cp is not None, flex=flex is not None)
    plan_in, plan_out = plan_channels(cfg, where, addrs, ctx, store)
    progress_in, progress_out = progress_channels(cfg, stage, addrs, ctx, store)
    io = StageIO(
        chan=TensorChannel(device), plan_in=plan_in, plan_out=plan_out,
        front_in=Puller(ctx, addrs.front_in) if where.decides else None,
        front_out=Pusher(ctx, addrs.front_out) if where.decides else None,
        alive=alive, report=lambda stats: ctl.send(StageStatus(rank, "stats", stats)),
        progress_in=progress_in, progress_out=progress_out,
    )  # fmt: skip
    loop = StageLoop(cfg, stage, model, blocks, pool, io, planner, device, spec.eos_ids, flex, where=where, tp=tp,
                     cp=cp)
    return loop, info


def _planner(cfg: EngineConfig, spec: ModelSpec, local: ModelConfig, blocks: BlockTable, device: torch.device, *,
             cp: bool, flex: bool) -> Planner:  # fmt: skip
    """Stage 0's planner over its own block table (with --cp-size, over every CP rank's: its own is the first, and it
    places each token); with --enable-dynamic-chunking, its chunk sizer from a start-up probe."""
    tables = [blocks] + [BlockTable(blocks.num_blocks, cfg.block_size) for _ in range(cfg.cp_size - 1)]
    allocator = CPBlocks(tables) if cp else blocks
    chunker = None
    if cfg.enable_dynamic_chunking:
        cost, decode = chunk_probe.probe(local, cfg.torch_dtype, device, cfg.chunked_prefill_size, spec.context_len,
                                         attention_backend=cfg.attention_backend)
        chunker = chunking.ChunkSizer(cost, cfg.chunked_prefill_size, decode=decode)
    return Planner(allocator, cfg.micro_batch_size, cfg.max_running_requests, cfg.chunked_prefill_size, spec.eos_ids,
                   spec.context_len, random.Random(cfg.seed), spec.config.vocab_size, flexible_cut=flex,
                   chunker=chunker)  # fmt: skip


def _threads_and_device(cfg: EngineConfig, local_rank: int) -> torch.device:
    keep_heap()
    torch.set_num_threads(cfg.threads)
    cpus = stage_cpus(cfg.threads, cfg.ranks_per_node, local_rank, cfg.resolved_device)
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
    if cfg.resolved_device == "cuda":
        torch.cuda.set_device(local_rank)
        set_matmul_precision(torch.device("cuda", local_rank))
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _ready_info(cfg: EngineConfig, where: RankInfo, stage: StageInfo, cut_layers: int, model, pool: KVPool,
                blocks: BlockTable) -> dict:  # fmt: skip
    info = {
        "stage": where.pp,
        "tp": where.tp,
        "cp": where.cp,
        "node": where.node,
        "layers": [stage.start_layer, stage.end_layer],
        "cut_layers": cut_layers,  # without --pp-flex-layers, the layer count
        "weights_bytes": weights_bytes(model),
        "kv_bytes": pool.nbytes,
        "kv_tokens": blocks.capacity_tokens,
        "request_kv_tokens": request_capacity(blocks.capacity_tokens, cfg.cp_size),  # spread over the CP ranks
        "pid": os.getpid(),
        "threads": torch.get_num_threads(),  # sized from the CPUs the launcher may use (EngineConfig.threads)
        "cpus": allowed_cpus(),  # after the stage pinned itself
    }
    logger.info(
        "layers %d-%d (%d), weights %.1f MiB, KV pool %.1f MiB = %d tokens", stage.start_layer,
        stage.end_layer - 1, stage.num_layers, info["weights_bytes"] / 2**20, pool.nbytes / 2**20,
        blocks.capacity_tokens,
    )  # fmt: skip
    return info


HEARTBEAT_PERIOD_S = 0.5


def _start_heartbeat(ctx: zmq.Context, addr: str, rank: int, loop: StageLoop) -> None:
    """A thread that tells the supervisor, every `HEARTBEAT_PERIOD_S`, that this process runs and how far its loop
    got: silence means the process is hung (stopped, or stuck holding the GIL); a step counter that stands
    still while the loop is inside a step means the loop is stuck. The thread has its own socket (ZMQ sockets
    are not thread-safe) and dies with the process."""

    def beat() -> None:
        try:
            sock = Pusher(ctx, addr)
            while True:
                info = {"sent_at": time.monotonic(), "steps": loop.steps, "in_step": loop.in_step}
                sock.send(StageStatus(rank, "heartbeat", info))
                time.sleep(HEARTBEAT_PERIOD_S)
        except zmq.ZMQError:  # the process is closing its sockets on the way down: nothing left to tell
            return

    threading.Thread(target=beat, name=f"heartbeat-{rank}", daemon=True).start()


def process_name(stage: int, tp: int | None = None, cp: int | None = None) -> str:
    """What `ps`, `top` and `pgrep` show for a rank: `ringsched-pp1`, or `ringsched-pp1t0` for tensor-parallel
    rank 0 of stage 1 (`ringsched-pp1c0`: context-parallel); at most 15 characters, the kernel's limit."""
    return f"ringsched-pp{stage}" + (f"t{tp}" if tp is not None else "") + (f"c{cp}" if cp is not None else "")


def kv_budget_bytes(cfg: EngineConfig, device: torch.device, free: int | None = None,
                    mcfg: ModelConfig | None = None) -> int:  # fmt: skip
    """`--kv-cache-memory` in bytes for one stage: as given, or its fraction of the free memory this stage may
    use (its GPU's; on CPU the node's available memory shared by the stages on this node). `free` overrides the
    measured free memory (tests); on a GPU, with the model's config `mcfg`, `device.activation_reserve` is taken
    off the free memory first."""
    budget = parse_memory(cfg.kv_cache_memory)
    if isinstance(budget, int):
        return budget
    if free is None and device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    elif free is None:
        import psutil

        free = psutil.virtual_memory().available
    if device.type == "cuda" and mcfg is not None:  # the fraction is of what a step's activations leave
        step = cfg.chunked_prefill_size + cfg.micro_batch_size
        free -= activation_reserve(step, cfg.micro_batch_size, mcfg.hidden_size, mcfg.intermediate_size,
                                   mcfg.vocab_size)  # fmt: skip
    if device.type != "cuda":
        free //= cfg.ranks_per_node
    return max(int(free * budget), 0)


def _kv_blocks(cfg: EngineConfig, mcfg: ModelConfig, stage: StageInfo, device: torch.device) -> int:
    budget = kv_budget_bytes(cfg, device, mcfg=mcfg)
    blocks = blocks_for_memory(mcfg, stage.num_layers, cfg.torch_dtype, budget, cfg.block_size)
    if cfg.world_size > 1:
        # Stage 0 admits against the smallest pool (over every rank); every rank allocates just that much.
        t = torch.tensor([blocks], dtype=torch.long, device=device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
        blocks = int(t.item())
    if blocks < 1:
        raise RuntimeError(f"--kv-cache-memory {cfg.kv_cache_memory} holds no KV block; raise it")
    return blocks


def _set_process_name(name: str) -> None:
    """So `ps`/`top` (and psutil's `name()`) show which stage a process is."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # 15 = PR_SET_NAME
    except (OSError, AttributeError):
        pass
