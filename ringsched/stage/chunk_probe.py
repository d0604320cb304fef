"""The start-up probe of dynamic chunking (`scheduler/chunking.py`): one randomly initialised layer of the model,
timed on this stage's threads and device, fitted to `ChunkCost` and `DecodeCost`. It runs the model, so it is a
stage's part; the scheduler keeps only the cost model and its inversion."""

from __future__ import annotations

import logging
import statistics
import time

import torch

from ringsched.scheduler.chunking import ChunkCost, DecodeCost

logger = logging.getLogger(__name__)

DECODE_ROWS, DECODE_CONTEXT = 16, 512  # the decode steps the probe times: 1 and 16 requests at this context


@torch.inference_mode()
def probe(
    mcfg,
    dtype: torch.dtype,
    device: torch.device,
    first: int,
    max_len: int,
    repeat: int = 3,
    attention_backend: str = "auto",
) -> tuple[ChunkCost, DecodeCost]:
    """Time one randomly initialised layer of the model on a `first`-token chunk at context 0 and at a long
    context (eight first chunks, within the context length), and on decode steps of 1 and 16 requests, on this
    process's threads; fit `ChunkCost` and `DecodeCost`."""
    from ringsched.attention.backend import select_backend
    from ringsched.comm.messages import BatchPlan, PlanEntry
    from ringsched.kv.cache import BlockTable, KVPool
    from ringsched.layout.rank import StageInfo
    from ringsched.models.llama import StageModel

    first = max(1, min(first, max_len - 1))
    context = max(0, min(8 * first, max_len - first))
    torch.manual_seed(0)
    model = StageModel(mcfg, StageInfo(0, 1, 0, 1)).to(device=device, dtype=dtype).lay_out_for_cpu().prepare_linears()
    dctx = min(DECODE_CONTEXT, max_len - 1)
    blocks = BlockTable(-(-(context + first) // 16) + DECODE_ROWS * -(-dctx // 16) + 2, 16)
    pool = KVPool(mcfg, 1, blocks.num_blocks, 16, dtype, device)
    attention = select_backend(attention_backend, device, dtype)  # the attention the stages will run

    def timed(start: int, decodes: int = 0) -> float:
        if decodes:
            entries = [PlanEntry(f"d{i}", dctx - 1, [i % mcfg.vocab_size], True) for i in range(decodes)]
        else:
            entries = [PlanEntry(f"p{start}", start, [i % mcfg.vocab_size for i in range(first)], True)]
        return _time_layer(model, blocks, pool, BatchPlan(slot=0, seq=0, entries=entries), device, attention, repeat)

    t0, t1 = timed(0), timed(context) if context else 0.0
    cost = ChunkCost.fit(first, t0, context, t1) if context else ChunkCost(t0 / first, 0.0)
    d1, dn = timed(0, 1), timed(0, DECODE_ROWS)
    decode = DecodeCost.fit(DECODE_ROWS, d1, dn)
    _log(first, context, t0, t1, d1, dn)
    return cost, decode


def _log(first: int, context: int, t0: float, t1: float, d1: float, dn: float) -> None:
    logger.info(
        "dynamic chunking: a %d-token chunk takes %.1f ms per layer at context 0 and %.1f ms at %d; a decode step "
        "%.2f ms (1 request) and %.2f ms (%d); chunks are sized to the first's time (at least %d tokens) or, beside "
        "decodes, to their step's (at least %d)",
        first,
        t0 * 1e3,
        t1 * 1e3,
        context,
        d1 * 1e3,
        dn * 1e3,
        DECODE_ROWS,
        max(1, first // 4),
        max(1, first // 32),
    )


def _time_layer(model, blocks, pool, plan, device: torch.device, attention, repeat: int) -> float:
    """The median time of the model's first layer on `plan`'s entries (after one warm-up run); their KV blocks are
    taken for the runs and freed after."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for e in plan.entries:
        blocks.ensure(e.rid, e.start + len(e.token_ids))
    batch, ids = attention.forward_batch(plan, blocks, device)
    hidden = model.model.embed_tokens(ids)
    residual = torch.randn_like(hidden)
    layer, cache = model.model.layers[0], pool.caches[0]
    layer(hidden.clone(), residual.clone(), batch, cache)  # warm up
    times = []
    for _ in range(repeat):
        sync()
        t = time.perf_counter()
        layer(hidden.clone(), residual.clone(), batch, cache)
        sync()
        times.append(time.perf_counter() - t)
    for e in plan.entries:
        blocks.free(e.rid)
    return statistics.median(times)
