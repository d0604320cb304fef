"""Dynamic chunk sizes (`--enable-dynamic-chunking`): each prefill chunk of a long prompt sized to take about as
long as its first.

A chunk of `n` tokens after `c` tokens of context costs a part that grows with its tokens (projections, MLP)
and a part that grows with the query-key pairs it attends over (`n * c + n * (n + 1) / 2`), so with a fixed
chunk size the last chunks of a long prompt are the slowest: on SmolLM2 a 512-token chunk at 5,500 tokens of
context costs about 2.5x the first. In a pipeline the stage behind waits on the stage ahead for that difference
at every step, and the prompt's last chunk, alone on the last stage, is the drain. Chunks of equal time keep the
stages in step and make the drain one first chunk long.

`ChunkCost` is that model with two coefficients, measured at start-up on one layer of the model (`probe`);
`ChunkSizer` inverts it. Only stage 0 sizes chunks: the sizes travel in the plan as the entries' lengths.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChunkCost:
    per_token: float  # seconds per token of the chunk (any unit, as long as both agree)
    per_pair: float  # seconds per query-key pair attended over

    def __post_init__(self) -> None:
        if not (self.per_token > 0 and self.per_pair >= 0 and math.isfinite(self.per_token + self.per_pair)):
            raise ValueError(f"a chunk cost needs per_token > 0 and per_pair >= 0, got {self}")

    @staticmethod
    def pairs(n: int, context: int) -> int:
        return n * context + n * (n + 1) // 2

    def time(self, n: int, context: int) -> float:
        return self.per_token * n + self.per_pair * self.pairs(n, context)

    @classmethod
    def fit(cls, n: int, t0: float, context: int, t1: float) -> ChunkCost:
        """From one chunk of `n` tokens timed at context 0 (`t0`) and at `context` (`t1`)."""
        per_pair = max(t1 - t0, 0.0) / (n * context)
        per_token = max(t0 - per_pair * cls.pairs(n, 0), 1e-3 * t0) / n
        return cls(per_token, per_pair)


class ChunkSizer:
    """The next chunk's length for a request: as long as the first chunk's time allows at its context, never
    below `floor` (a quarter of the first chunk unless given), and never leaving a tail shorter than `floor`."""

    def __init__(self, cost: ChunkCost, first: int, floor: int | None = None) -> None:
        if first < 1:
            raise ValueError(f"the first chunk needs at least one token, got {first}")
        self.cost, self.first = cost, first
        self.floor = max(1, min(first, floor if floor is not None else first // 4))
        self.target = cost.time(first, 0)

    def fit(self, context: int) -> int:
        """The longest chunk at `context` whose modelled time is at most the first chunk's, within [floor, first]."""
        a, b = self.cost.per_token, self.cost.per_pair
        if b == 0:
            return self.first
        lin = a + b * (context + 0.5)  # time(n) = b/2 n^2 + lin n
        n = int((-lin + math.sqrt(lin * lin + 2 * b * self.target)) / b)
        return max(self.floor, min(self.first, n))

    def size(self, context: int, remaining: int) -> int:
        n = self.fit(context)
        if remaining <= n:
            return remaining
        if remaining - n < self.floor:  # shorten this chunk so the last is `floor` long, not a sliver
            return max(remaining - self.floor, self.floor) if remaining >= 2 * self.floor else remaining
        return n

    def plan(self, prompt: int) -> list[int]:
        """The chunk lengths a `prompt`-token prefill gets alone (no decodes sharing the budget)."""
        sizes, done = [], 0
        while done < prompt:
            sizes.append(self.size(done, prompt - done))
            done += sizes[-1]
        return sizes


@torch.inference_mode()
def probe(mcfg, dtype: torch.dtype, device: torch.device, first: int, max_len: int, repeat: int = 3) -> ChunkCost:
    """Time one randomly initialised layer of the model on a `first`-token chunk at context 0 and at a long
    context (eight first chunks, within the context length), on this process's threads; fit `ChunkCost`."""
    from ringsched.comm.messages import BatchPlan, PlanEntry
    from ringsched.kv_cache import BlockTable, KVPool
    from ringsched.models import native
    from ringsched.models.batch import build_forward_batch
    from ringsched.models.llama import StageModel
    from ringsched.parallel.rank import StageInfo

    first = max(1, min(first, max_len - 1))
    context = max(0, min(8 * first, max_len - first))
    torch.manual_seed(0)
    model = StageModel(mcfg, StageInfo(0, 1, 0, 1)).to(device=device, dtype=dtype).lay_out_for_cpu()
    blocks = BlockTable(-(-(context + first) // 16) + 2, 16)
    pool = KVPool(mcfg, 1, blocks.num_blocks, 16, dtype, device)
    use_native = native.usable_for(dtype, device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def timed(start: int) -> float:
        rid = f"probe{start}"
        blocks.ensure(rid, start + first)
        plan = BatchPlan(slot=0, seq=0, entries=[PlanEntry(rid, start, [100 + i % 1000 for i in range(first)], True)])
        batch, ids = build_forward_batch(plan, blocks, device, use_native)
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
        blocks.free(rid)
        return statistics.median(times)

    t0, t1 = timed(0), timed(context) if context else 0.0
    cost = ChunkCost.fit(first, t0, context, t1) if context else ChunkCost(t0 / first, 0.0)
    logger.info(
        "dynamic chunking: a %d-token chunk takes %.1f ms per layer at context 0 and %.1f ms at %d; chunks are "
        "sized to the first's time, at least %d tokens", first, t0 * 1e3, t1 * 1e3, context, max(1, first // 4),
    )  # fmt: skip
    return cost
