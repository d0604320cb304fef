"""What a rank sets up before its loop runs, split by how long it lives.

Once per process (`RankSetup.__init__` and the first `connect`): threads and device, this stage's weights (only
its own layers, only its slice of each), its linear layers' paths, its KV pool. Once per generation of the ring
(`connect`, undone by `leave`): the process group and the stage's TP/CP group, the KV block table (empty), stage
0's planner (empty), the ZMQ channels and the loop over them. A rank that survives the replacement of another
(`stage/rejoin.py`) leaves its generation and connects again with its weights and pool as they are.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import random

import torch

from ringsched.attention.backend import AttentionBackend, select_backend
from ringsched.attention.cp_backend import CPBackend
from ringsched.comm.messages import StageStatus
from ringsched.comm.tensor_channel import TensorChannel
from ringsched.comm.zmq_io import Puller, Pusher
from ringsched.config import EngineConfig
from ringsched.device import gpu_index, set_matmul_precision
from ringsched.kernels import linear_tuning, prepare
from ringsched.kv.cache import BlockTable, KVPool
from ringsched.kv.cp_blocks import CPBlocks, request_capacity
from ringsched.layout.rank import RankInfo, StageInfo
from ringsched.models.loader import load_stage_model, weights_bytes
from ringsched.scheduler import chunking
from ringsched.scheduler.planner import Planner
from ringsched.scheduler.speculation import NO_DRAFTS, Speculator
from ringsched.spec import ModelSpec
from ringsched.speculative.config import SpeculativeConfig
from ringsched.stage import chunk_probe, rejoin, static_batches
from ringsched.stage.affinity import allowed_cpus, stage_cpus
from ringsched.stage.channels import generation_store, plan_channels, progress_channels
from ringsched.stage.groups import process_groups
from ringsched.stage.heap import keep_heap
from ringsched.stage.kv_setup import block_table, kv_blocks, ring_of, sliding_layers
from ringsched.stage.loop import StageIO, StageLoop
from ringsched.stage.nccl import release_groups, waits_for
from ringsched.weights.model_config import ModelConfig

logger = logging.getLogger("ringsched.layout.rank")

KV_BLOCKS_KEY = "ring/kv_blocks"  # the pool size every rank agreed on in its first generation


class ParentGone(RuntimeError):
    pass


class RankSetup:
    def __init__(self, cfg: EngineConfig, spec: ModelSpec, where: RankInfo, addrs, ctx, ctl) -> None:
        self.cfg, self.spec, self.where, self.addrs, self.ctx, self.ctl = cfg, spec, where, addrs, ctx, ctl
        self.parent = os.getppid()
        self.device = _threads_and_device(cfg, where.local_rank)
        self.model = self.pool = self.tp = self.cp = self.store = self.loop = None
        self.stage, self.flex, self.num_blocks = where.stage, None, (0, 0)

    def alive(self) -> None:
        """Raises when this rank should stop (the launcher is gone) or leave its generation (`Rejoin`)."""
        self.parent_alive()
        rejoin.check()

    def parent_alive(self) -> None:
        if os.getppid() != self.parent:
            raise ParentGone("the launcher is gone")

    def connect(self, generation: int) -> tuple[StageLoop, dict]:
        """Join generation `generation` of the ring: its loop, and what this rank reports as ready."""
        cfg, where = self.cfg, self.where
        self.store, tp, cp, back = process_groups(cfg, where, generation)
        if self.model is None:
            self.tp, self.cp = tp, cp
            self._load()
        else:  # the layers hold the group objects they were built with: give those the new generation's groups
            for mine, new in ((self.tp, tp), (self.cp, cp)):
                if mine is not None:
                    mine.rebind(new)
        local = self.tp.shard.local_config(self.spec.config) if self.tp else self.spec.config  # its KV heads
        num_blocks, ring_blocks = self.num_blocks = self._kv_blocks(local, generation)
        ring = ring_of(cfg, local)
        if self.pool is None:
            self.pool = self._pool(local, num_blocks, ring_blocks)
        attention = self._attention()
        static = static_batches.eligible(cfg.static_batches, attention, self.flex is not None, bool(ring))
        # Static decode steps (CUDA graphs): their padding rows write one block the table never hands out
        blocks = block_table(cfg, local, num_blocks - static, ring_blocks, ring, follower=not where.decides)
        if cfg.enable_prefix_caching and ring and where.decides and generation == 0:
            logger.info("prefix caching off: a cached prefix would have no KV in the sliding layers' rings")
        planner = (
            _planner(cfg, self.spec, local, blocks, self.device, cp=cp is not None, flex=self.flex is not None)
            if where.decides
            else None
        )
        self.loop = StageLoop(
            cfg,
            self.stage,
            self.model,
            blocks,
            self.pool,
            self._io(generation, back),
            planner,
            self.device,
            self.spec.eos_ids,
            self.flex,
            where=where,
            tp=self.tp,
            attention=attention,
            static=(num_blocks - 1, self.spec.context_len) if static else None,
        )
        info = _ready_info(cfg, where, self.stage, self.spec.partition[self.stage.rank], self.model, self.pool, blocks)
        return self.loop, {**info, "generation": generation}

    def _pool(self, local: ModelConfig, num_blocks: int, ring_blocks: int) -> KVPool:
        return KVPool(
            local,
            self.stage.num_layers,
            num_blocks,
            self.cfg.block_size,
            self.cfg.torch_dtype,
            self.device,
            sliding=sliding_layers(local, self.stage),
            ring_blocks=ring_blocks,
        )

    def _load(self) -> None:
        cfg, where, mcfg = self.cfg, self.where, self.spec.config
        self.flex = cfg.flex_boundary(mcfg.num_layers, list(self.spec.partition))
        if self.flex:  # with a flexible cut, the stage also holds the shared layers around the cut
            held = self.flex.held(where.pp)
            self.stage = dataclasses.replace(self.stage, start_layer=held[0], end_layer=held[1])
            if where.decides:
                logger.info(
                    "flexible cut: stage 0 runs the first %d to %d layers of each micro-batch",
                    self.flex.lo,
                    self.flex.hi,
                )
        self.model = load_stage_model(
            self.spec.model_dir, self.stage, cfg.torch_dtype, self.device, tp=self.tp, quantization=cfg.quantization
        )
        if cfg.enable_deterministic_inference:
            left = self.model.batch_invariant()
            logger.info(
                "deterministic inference: every row count takes the native kernels%s",
                f" but in {', '.join(left)} (torch's path, not batch-invariant)" if left else "",
            )
        else:
            linear_tuning.tune_stage(self.model, cfg.linear_tuning, cfg.torch_dtype)  # its threads, weights: after both

    def _attention(self) -> AttentionBackend:
        """How the stage's layers attend, chosen once: the backend `--attention-backend` names for its KV dtype, or
        under `--cp-size` the context-parallel group's attention (which keeps the backend's CPU decode kernel)."""
        kv_dtype = self.pool.caches[0][0].dtype if self.pool.caches else self.cfg.torch_dtype
        backend = select_backend(self.cfg.attention_backend, self.device, kv_dtype)
        return CPBackend(self.cp, backend.native_decode) if self.cp else backend

    def _kv_blocks(self, local: ModelConfig, generation: int) -> tuple[int, int]:
        """(main, sliding) pool blocks. The first generation agrees on the smallest pools of any rank (and records
        them); a later one keeps them, so a replacement allocates what the survivors hold, whatever memory the
        machine has free by then."""
        if self.pool is not None:
            return self.num_blocks
        if generation > 0 and self.store is not None and self.store.check([KV_BLOCKS_KEY]):
            main, sliding = self.store.get(KV_BLOCKS_KEY).decode().split(",")
            return int(main), int(sliding)
        blocks = kv_blocks(self.cfg, local, self.stage, self.device, self.spec.context_len)
        if self.store is not None and self.where.rank == 0:
            self.store.set(KV_BLOCKS_KEY, f"{blocks[0]},{blocks[1]}")
        return blocks

    def _io(self, generation: int, back) -> StageIO:
        cfg, where, addrs, ctx, ctl = self.cfg, self.where, self.addrs, self.ctx, self.ctl
        store = generation_store(self.store, generation)
        plan_in, plan_out = plan_channels(cfg, where, addrs, ctx, store)
        progress_in, progress_out = progress_channels(cfg, self.stage, addrs, ctx, store)
        return StageIO(
            seam=TensorChannel(self.device, poll=waits_for(cfg, self.alive)),
            back=TensorChannel("cpu", group=back) if cfg.pp_size > 1 else None,
            plan_in=plan_in,
            plan_out=plan_out,
            front_in=Puller(ctx, addrs.front_in) if where.decides else None,
            front_out=Pusher(ctx, addrs.front_out) if where.decides else None,
            alive=self.alive,
            report=lambda stats: ctl.send(StageStatus(where.rank, "stats", stats)),
            progress_in=progress_in,
            progress_out=progress_out,
        )

    def leave(self) -> None:
        """Undo `connect`: the loop's sockets (unsent messages dropped), the shared memory of the stage's group,
        the process group. Weights and KV pool stay. The loop (and the sends it still holds) goes first, so the
        group's connections close at once and a neighbour blocked on one of them fails instead of waiting."""
        loop, self.loop = self.loop, None
        io = loop.io if loop is not None else None
        del loop
        if io is not None:
            for sock in (io.plan_in, io.plan_out, io.front_in, io.front_out, io.progress_in, io.progress_out):
                if sock is not None:
                    sock.close(**({} if isinstance(sock, Puller) else {"linger_ms": 0}))
            io.seam = io.back = None
        for group in (self.tp, self.cp):
            if group is not None and group.shm is not None:
                group.shm.close()
                group.shm = None
        release_groups(self.cfg.backend)  # aborted on NCCL (`stage/nccl.py`), before the next generation's are made
        gc.unfreeze()  # the loop froze what it found at its start (`GcPolicy`), itself included: collect it now
        gc.collect()


def _planner(
    cfg: EngineConfig,
    spec: ModelSpec,
    local: ModelConfig,
    blocks: BlockTable,
    device: torch.device,
    *,
    cp: bool,
    flex: bool,
) -> Planner:
    """Stage 0's planner over its own block table (with --cp-size, over every CP rank's: its own is the first, and it
    places each token); with --enable-dynamic-chunking, its chunk sizer from a start-up probe."""
    tables = [blocks] + [BlockTable(blocks.num_blocks, cfg.block_size) for _ in range(cfg.cp_size - 1)]
    allocator = CPBlocks(tables) if cp else blocks
    chunker = None
    if cfg.enable_dynamic_chunking:
        cost, decode = chunk_probe.probe(
            local,
            cfg.torch_dtype,
            device,
            cfg.chunked_prefill_size,
            spec.context_len,
            attention_backend=cfg.attention_backend,
        )
        chunker = chunking.ChunkSizer(cost, cfg.chunked_prefill_size, decode=decode)
    speculator = NO_DRAFTS
    if cfg.speculative_config:  # drafting is stage 0's alone; drafts are placed like the planner's tokens
        speculator = Speculator(SpeculativeConfig.parse(cfg.speculative_config), allocator, spec.context_len)
    return Planner(
        allocator,
        cfg.micro_batch_size,
        cfg.max_running_requests,
        cfg.chunked_prefill_size,
        spec.eos_ids,
        spec.context_len,
        random.Random(cfg.seed),
        spec.config.vocab_size,
        flexible_cut=flex,
        chunker=chunker,
        speculator=speculator,
    )


def _threads_and_device(cfg: EngineConfig, local_rank: int) -> torch.device:
    keep_heap()
    torch.set_num_threads(cfg.threads)
    cpus = stage_cpus(cfg.threads, cfg.ranks_per_node, local_rank, cfg.resolved_device)
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
    if cfg.resolved_device == "cuda":
        device = torch.device("cuda", gpu_index(local_rank))
        torch.cuda.set_device(device)
        set_matmul_precision(device)
        return device
    prepare.build_native(gguf=cfg.quantization == "gguf")  # before "ready": no request waits for a compiler
    return torch.device("cpu")


def _ready_info(
    cfg: EngineConfig, where: RankInfo, stage: StageInfo, cut_layers: int, model, pool: KVPool, blocks: BlockTable
) -> dict:
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
        "layers %d-%d (%d), weights %.1f MiB, KV pool %.1f MiB = %d tokens",
        stage.start_layer,
        stage.end_layer - 1,
        stage.num_layers,
        info["weights_bytes"] / 2**20,
        pool.nbytes / 2**20,
        blocks.capacity_tokens,
    )
    return info
