"""How many drafts each request verifies in a step: as many as raise the step's expected tokens per second.

A request whose drafts have been kept at rate `a` (`Acceptance`: the kept fraction of its recent drafts, from a
prior) keeps its `j`-th draft of a step with probability about `a ** j`, so its step yields `1 + a + ... + a ** k`
tokens for `k` drafts. A step of `rows` rows costs `cost(rows)` seconds (`StepCosts`: measured step times, guessed
optimistically where not yet measured, so a guess is tried once and then known). Starting from no drafts (one row
a request), `choose` adds one draft at a time to the request whose next draft is likeliest kept, up to every draft
there is, and keeps the prefix of those additions with the most expected tokens per second (one noisy bucket must
not hide a cheaper step further on): where 6 rows cost about what 1 costs, one request drafts up to its limit; at
high concurrency a step is compute-bound, each draft costs its share of a row, and drafting stops unless nearly
every draft is kept.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

PRIOR_RATE, PRIOR_WEIGHT = 0.5, 4.0  # a new request's drafts: as if 2 of 4 had been kept
DECAY = 0.9  # the weight an acceptance history keeps per verified step (recent steps count most)
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
COST_DECAY = 0.8  # a bucket's cost: this much of the previous value, the rest the new step's time
STALE_STEPS = 256  # a bucket not measured for this many steps is guessed again (the machine's load changes)


class Acceptance:
    """A request's draft acceptance: kept and proposed counts decayed per step, starting from the prior."""

    def __init__(self) -> None:
        self.kept, self.proposed = PRIOR_RATE * PRIOR_WEIGHT, PRIOR_WEIGHT

    def record(self, proposed: int, kept: int) -> None:
        if proposed:
            self.kept = DECAY * self.kept + kept
            self.proposed = DECAY * self.proposed + proposed

    @property
    def rate(self) -> float:
        return self.kept / self.proposed


class StepCosts:
    """Seconds a step of `rows` rows takes, learned from the steps run: per bucket of rows (the bucket at or above
    a step's rows) a decayed mean of its steps' times; between measured buckets, linear. Unmeasured row counts are
    guessed optimistically so that drafting is tried and thereby measured: with nothing measured every step costs
    the same, and past the largest measured bucket `L` a step costs what `L` costs up to `2 L` rows, then grows in
    proportion to the rows. A bucket not measured for `STALE_STEPS` steps counts as unmeasured again, so a cost
    that once kept drafting off (a noisy step, a busy moment) is tried again."""

    def __init__(self) -> None:
        self.seconds: dict[int, float] = {}
        self.measured_at: dict[int, int] = {}  # bucket -> the step that last measured it
        self.steps = 0

    def record(self, rows: int, seconds: float) -> None:
        i = bisect.bisect_left(BUCKETS, rows)
        b = BUCKETS[min(i, len(BUCKETS) - 1)]
        scaled = seconds * b / rows if rows > b else seconds  # past the last bucket: scaled to it
        self.steps += 1
        if self.steps - self.measured_at.get(b, self.steps) > STALE_STEPS:
            self.seconds.pop(b, None)
        old = self.seconds.get(b)
        self.seconds[b] = scaled if old is None else COST_DECAY * old + (1 - COST_DECAY) * scaled
        self.measured_at[b] = self.steps

    def __call__(self, rows: int) -> float:
        known = sorted(b for b in self.seconds if self.steps - self.measured_at[b] <= STALE_STEPS)
        if not known:
            return 1.0
        above = [b for b in known if b >= rows]
        if not above:
            top = known[-1]
            return self.seconds[top] * max(1.0, rows / (2 * top))
        below = [b for b in known if b <= rows]
        if not below:
            return self.seconds[above[0]]
        lo, hi = below[-1], above[0]
        if lo == hi:
            return self.seconds[lo]
        t = (rows - lo) / (hi - lo)
        return (1 - t) * self.seconds[lo] + t * self.seconds[hi]


def choose(
    rates: Sequence[float], limits: Sequence[int], cost: Callable[[int], float], other_rows: int = 0
) -> list[int]:
    """Drafts per decoding request: `rates[r]` its acceptance, `limits[r]` the drafts it has (at most the
    configured number); `other_rows` the step's rows besides the decodes (prefill chunks, each worth a token: its
    work is owed anyway). Drafts are added greedily by the next draft's keep probability; the prefix of those
    additions with the most expected tokens per second is kept."""
    k = [0] * len(rates)
    gain = [1.0] * len(rates)  # probability the request's next draft is kept: rate ** (k + 1)
    rows = len(rates) + other_rows
    tokens = float(rows)
    added: list[int] = []  # the requests given a draft, in order
    best, best_n = tokens / cost(rows), 0
    while True:
        candidates = [r for r in range(len(rates)) if k[r] < limits[r]]
        if not candidates:
            break
        r = max(candidates, key=lambda i: gain[i] * rates[i])
        gain[r] *= rates[r]
        k[r] += 1
        rows += 1
        tokens += gain[r]
        added.append(r)
        if tokens / cost(rows) > best:
            best, best_n = tokens / cost(rows), len(added)
    out = [0] * len(rates)
    for r in added[:best_n]:
        out[r] += 1
    return out
