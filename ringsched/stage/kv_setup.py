"""A stage's KV memory: the budget `--kv-cache-memory` gives it (`kv_budget_bytes`), that budget's split between the
full and the sliding layers' pools, agreed over every rank (`kv_blocks`), and the block table over them
(`block_table`: with sliding layers, `kv/ring.py`'s `SlidingBlockTable`)."""

from __future__ import annotations

import logging

import torch

from ringsched.config import EngineConfig, parse_memory
from ringsched.device import activation_reserve, one_gpu
from ringsched.kv.cache import BlockTable
from ringsched.kv.ring import RingTable, SlidingBlockTable, ring_size, split_budget
from ringsched.layout.rank import StageInfo
from ringsched.weights.model_config import ModelConfig

logger = logging.getLogger("ringsched.layout.rank")


def kv_budget_bytes(
    cfg: EngineConfig, device: torch.device, free: int | None = None, mcfg: ModelConfig | None = None
) -> int:
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
        free -= activation_reserve(
            step, cfg.micro_batch_size, mcfg.hidden_size, mcfg.intermediate_size, mcfg.vocab_size
        )
    if device.type != "cuda" or one_gpu():  # the node's memory, or its one GPU, shared by its ranks
        free //= cfg.ranks_per_node
    return max(int(free * budget), 0)


def block_table(cfg: EngineConfig, mcfg: ModelConfig, main: int, sliding: int, ring: int, follower: bool) -> BlockTable:
    """The stage's KV blocks: with sliding layers, the main table and the rings of the sliding pool."""
    if ring:
        rings = RingTable(sliding, cfg.block_size, ring, mcfg.sliding_window, follower=follower)
        return SlidingBlockTable(main, cfg.block_size, rings, follower=follower)
    return BlockTable(main, cfg.block_size, follower=follower, prefix_caching=cfg.enable_prefix_caching)


def ring_of(cfg: EngineConfig, mcfg: ModelConfig) -> int:
    """Blocks of one request's full ring of sliding KV (`kv/ring.py`; a chunk of at most --chunked-prefill-size),
    0 for a model without sliding layers."""
    return ring_size(mcfg.sliding_window, cfg.chunked_prefill_size, cfg.block_size) if mcfg.has_sliding else 0


def sliding_layers(mcfg: ModelConfig, stage: StageInfo) -> list[bool]:
    return [bool(mcfg.window(i)) for i in range(stage.start_layer, stage.end_layer)]


def kv_blocks(
    cfg: EngineConfig, mcfg: ModelConfig, stage: StageInfo, device: torch.device, context_len: int
) -> tuple[int, int]:
    """(main, sliding) pool blocks: the budget split between the full and the sliding layers (`split_budget`), the
    smallest of every rank's. A main table no rank bounds (sliding layers only) holds every running request's whole
    context; a model without sliding layers has no sliding pool (0)."""
    budget = kv_budget_bytes(cfg, device, mcfg=mcfg)
    sliding, ring = sum(sliding_layers(mcfg, stage)), ring_of(cfg, mcfg)
    elt = torch.empty((), dtype=cfg.torch_dtype).element_size()
    context_blocks = -(-context_len // cfg.block_size)
    blocks = split_budget(
        budget,
        mcfg.kv_bytes_per_token_per_layer * elt * cfg.block_size,
        stage.num_layers - sliding,
        sliding,
        max(ring, 1),
        context_blocks,
    )
    if cfg.world_size > 1:
        # Stage 0 admits against the smallest pools (over every rank); every rank allocates just that much.
        unbounded = 2**62
        t = torch.tensor([b if b >= 0 else unbounded for b in blocks], dtype=torch.long, device=device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
        blocks = tuple(b if b < unbounded else -1 for b in t.tolist())
    main, slides = blocks
    main = main if main >= 0 else cfg.max_running_requests * context_blocks
    if main < 1 or (ring and slides < 1):
        raise RuntimeError(f"--kv-cache-memory {cfg.kv_cache_memory} holds no KV block; raise it")
    if ring:
        logger.info(
            "KV: %d main blocks for %d full layers, %d sliding blocks (rings of up to %d) for %d sliding layers",
            main,
            stage.num_layers - sliding,
            slides,
            ring,
            sliding,
        )
    return main, max(slides, 0)
