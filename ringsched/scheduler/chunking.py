"""Dynamic chunk sizes (`--enable-dynamic-chunking`): each prefill chunk of a long prompt sized to take about as
long as its first.

A chunk of `n` tokens after `c` tokens of context costs a part that grows with its tokens (projections, MLP)
and a part that grows with the query-key pairs it attends over (`n * c + n * (n + 1) / 2`), so with a fixed
chunk size the last chunks of a long prompt are the slowest: on SmolLM2 a 512-token chunk at 4,096 tokens of
context costs 2.8x the first. In a pipeline the stage behind waits on the stage ahead for that difference
at every step, and the prompt's last chunk, alone on the last stage, is the drain. Chunks of equal time keep the
stages in step and make the drain one first chunk long.

While other requests are decoding, a chunk shares their micro-batch (or the ring's next slot) and every
stream's time per token grows by the chunk's time: then a chunk may take at most as long as one step of the
running decodes (`DecodeCost`), so those streams' TPOT stays within about twice its value while a long prompt
fills the ring, and the floor drops to 1/32 of the first chunk.

`ChunkCost` and `DecodeCost` are measured at start-up on one layer of the model (`probe`); `ChunkSizer`
inverts them. Only stage 0 sizes chunks: the sizes travel in the plan as the entries' lengths.
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


@dataclass(frozen=True)
class DecodeCost:
    fixed: float  # seconds of a decode step whatever its rows (reading the weights)
    per_row: float  # seconds per decoding request in it

    def time(self, rows: int) -> float:
        return self.fixed + self.per_row * rows

    @classmethod
    def fit(cls, rows: int, t_one: float, t_rows: float) -> DecodeCost:
        """From a step of one decode (`t_one`) and one of `rows` decodes (`t_rows`)."""
        per_row = max(t_rows - t_one, 0.0) / max(rows - 1, 1)
        return cls(max(t_one - per_row, 0.0), per_row)


class ChunkSizer:
    """The next chunk's length for a request: as long as the first chunk's time allows at its context (or, while
    requests decode, one decode step's), never below `floor` (a quarter of the first chunk unless given; 1/32
    beside decodes), and never leaving a tail shorter than the floor."""

    def __init__(self, cost: ChunkCost, first: int, floor: int | None = None,
                 decode: DecodeCost | None = None) -> None:  # fmt: skip
        if first < 1:
            raise ValueError(f"the first chunk needs at least one token, got {first}")
        self.cost, self.first, self.decode = cost, first, decode
        self.floor = max(1, min(first, floor if floor is not None else first // 4))
        self.shared_floor = max(1, min(self.floor, first // 32))
        self.target = cost.time(first, 0)

    def fit(self, context: int, target: float | None = None, floor: int | None = None) -> int:
        """The longest chunk at `context` whose modelled time is at most `target` (the first chunk's), within
        [floor, first]."""
        a, b = self.cost.per_token, self.cost.per_pair
        target = self.target if target is None else target
        floor = self.floor if floor is None else floor
        lin = a + b * (context + 0.5)  # time(n) = b/2 n^2 + lin n
        x = target / lin if b == 0 else (-lin + math.sqrt(lin * lin + 2 * b * target)) / b
        n = int(x * (1 + 1e-9))  # the first chunk's own length, not one less by rounding
        return max(floor, min(self.first, n))

    def size(self, context: int, remaining: int, decoding: int = 0) -> int:
        """`decoding`: requests decoding now (in this micro-batch or in flight), whose steps the chunk delays."""
        target, floor = self.target, self.floor
        if decoding and self.decode is not None:
            target, floor = min(target, self.decode.time(decoding)), self.shared_floor
        n = self.fit(context, target, floor)
        if remaining <= n:
            return remaining
        if remaining - n < floor:  # shorten this chunk so the last is `floor` long, not a sliver
            return max(remaining - floor, floor) if remaining >= 2 * floor else remaining
        return n

    def plan(self, prompt: int) -> list[int]:
        """The chunk lengths a `prompt`-token prefill gets alone (no decodes sharing the budget)."""
        sizes, done = [], 0
        while done < prompt:
            sizes.append(self.size(done, prompt - done))
            done += sizes[-1]
        return sizes


DECODE_ROWS, DECODE_CONTEXT = 16, 512  # the decode steps the probe times: 1 and 16 requests at this context


@torch.inference_mode()
def probe(mcfg, dtype: torch.dtype, device: torch.device, first: int, max_len: int,
          repeat: int = 3) -> tuple[ChunkCost, DecodeCost]:  # fmt: skip
    """Time one randomly initialised layer of the model on a `first`-token chunk at context 0 and at a long
    context (eight first chunks, within the context length), and on decode steps of 1 and 16 requests, on this
    process's threads; fit `ChunkCost` and `DecodeCost`."""
    from ringsched.comm.messages import BatchPlan, PlanEntry
    from ringsched.kv.cache import BlockTable, KVPool
    from ringsched.layout.rank import StageInfo
    from ringsched.models.attention_backend import select_backend
    from ringsched.models.llama import StageModel

    first = max(1, min(first, max_len - 1))
    context = max(0, min(8 * first, max_len - first))
    torch.manual_seed(0)
    model = StageModel(mcfg, StageInfo(0, 1, 0, 1)).to(device=device, dtype=dtype).lay_out_for_cpu().prepare_linears()
    dctx = min(DECODE_CONTEXT, max_len - 1)
    blocks = BlockTable(-(-(context + first) // 16) + DECODE_ROWS * -(-dctx // 16) + 2, 16)
    pool = KVPool(mcfg, 1, blocks.num_blocks, 16, dtype, device)
    attention = select_backend("auto", device, dtype)  # the attention the stages will run
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def timed(start: int, decodes: int = 0) -> float:
        if decodes:
            entries = [PlanEntry(f"d{i}", dctx - 1, [i % mcfg.vocab_size], True) for i in range(decodes)]
        else:
            entries = [PlanEntry(f"p{start}", start, [i % mcfg.vocab_size for i in range(first)], True)]
        for e in entries:
            blocks.ensure(e.rid, e.start + len(e.token_ids))
        batch, ids = attention.forward_batch(BatchPlan(slot=0, seq=0, entries=entries), blocks, device)
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
        for e in entries:
            blocks.free(e.rid)
        return statistics.median(times)

    t0, t1 = timed(0), timed(context) if context else 0.0
    cost = ChunkCost.fit(first, t0, context, t1) if context else ChunkCost(t0 / first, 0.0)
    d1, dn = timed(0, 1), timed(0, DECODE_ROWS)
    decode = DecodeCost.fit(DECODE_ROWS, d1, dn)
    logger.info(
        "dynamic chunking: a %d-token chunk takes %.1f ms per layer at context 0 and %.1f ms at %d; a decode step "
        "%.2f ms (1 request) and %.2f ms (%d); chunks are sized to the first's time (at least %d tokens) or, beside "
        "decodes, to their step's (at least %d)", first, t0 * 1e3, t1 * 1e3, context, d1 * 1e3, dn * 1e3,
        DECODE_ROWS, max(1, first // 4), max(1, first // 32),
    )  # fmt: skip
    return cost, decode
