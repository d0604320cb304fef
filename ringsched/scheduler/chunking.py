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

`ChunkCost` and `DecodeCost` are measured at start-up on one layer of the model (`stage/chunk_probe.py`);
`ChunkSizer` inverts them. Only stage 0 sizes chunks: the sizes travel in the plan as the entries' lengths.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


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

    def __init__(self, cost: ChunkCost, first: int, floor: int | None = None, decode: DecodeCost | None = None) -> None:
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
