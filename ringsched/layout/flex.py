"""A flexible boundary between the two stages of a PP=2 ring (`--pp-flex-layers K`).

Why: a static cut balances the *mean* micro-batch, but the two stages weigh micro-batches differently. The
last stage runs the lm_head on the rows that sample (one per decode, one per prefill chunk), so a decode-heavy
micro-batch is heavier there and a prefill-heavy one is heavier on stage 0. Under a burst of new requests the
first hundred micro-batches are prefill-heavy and stage 1 waited ~20% of that phase; in the decode phase that
follows, stage 0 waited (measured on SmolLM2, [17, 13], 256 requests of 128 + 128 tokens: 113 s of ring time
for 104 s of mean stage compute).

How: both stages hold the `2K` layers around the partition's cut (weights and KV), and stage 0 picks a cut in
`[base - K, base + K]` for each micro-batch. Stage 0 runs layers `[0, cut)`, stage 1 `[cut, L)`. The K/V rows a
stage writes for the shared layers it ran are mirrored to the other stage (with the proxy tensors forward, with
the sampled tokens back), so whichever stage runs a shared layer next finds the whole context in its own cache.
A request decodes in at most one in-flight micro-batch, so the mirror lands before it is computed again; its prompt
chunks may be in several, and stage 0 cuts a chunk no later than the in-flight chunks it reads (`plan.reads`): until
their outputs are back it holds their shared layers' K/V only up to their cut.
Stage 1 reads the cut from the proxy: the K/V rows stage 0 sends are those of layers `[base - K, cut)`.

Two policies choose the cut (`--pp-flex-policy`; a third, `cycle`, is for tests and no flag offers it).
`balance` predicts it before the micro-batch starts, from what the stages measured: stage 0 times its own
layers, stage 1 reports its compute time with the sampled tokens, each adding its mean time per micro-batch
outside the model (`FlexRing.note_overhead`); from the two
times of each micro-batch `CutChooser` learns which cut would have balanced it, as a function of the micro-batch's
sampled rows per token. `ready` decides it while the micro-batch runs: stage 0 runs the shared layers one at a time
until stage 1 is ready for it, or about to be (`stage/flex_ready.py`). Why: at depth 0 the two micro-batches
alternate in lock-step, and the moment stage 1 is free is also the moment stage 0 gets the sampled tokens it needs
to plan its next micro-batch. Cutting earlier leaves stage 0 waiting for those tokens, cutting later leaves stage 1
waiting; a predicted cut cannot follow a step that runs 10% slow on a noisy host, a measured one can. It needs each
layer to have finished when Python moves on, so it is for CPU stages (on a GPU the layers are queued ahead and the
check would come too early).
"""

from __future__ import annotations

from dataclasses import dataclass

FLEX_POLICIES = ("balance", "ready")  # --pp-flex-policy's choices
CYCLE = "cycle"  # every cut in turn: tests set it through EngineConfig; no flag offers it
# Observations before the chooser trusts its fit (until then: the partition's own cut).
WARMUP_OBSERVATIONS = 8
# Weight of older observations in the fits: ~50 micro-batches of memory follows a host whose speed drifts.
DECAY = 0.98


@dataclass(frozen=True)
class FlexBoundary:
    """The cut range of a PP=2 ring: `lo <= cut <= hi` around the partition's `base` cut."""

    num_layers: int
    base: int
    k: int

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError(f"a flexible boundary needs k >= 1, got {self.k}")
        if self.lo < 1 or self.hi > self.num_layers - 1:
            raise ValueError(
                f"--pp-flex-layers {self.k} around the cut after layer {self.base} leaves a stage with no layer "
                f"of its own; use at most {min(self.base, self.num_layers - self.base) - 1}"
            )

    @property
    def lo(self) -> int:
        return self.base - self.k

    @property
    def hi(self) -> int:
        return self.base + self.k

    def held(self, rank: int) -> tuple[int, int]:
        """The `[start, end)` layers stage `rank` holds: its own plus the shared ones."""
        return (0, self.hi) if rank == 0 else (self.lo, self.num_layers)

    def run_range(self, rank: int, cut: int) -> range:
        return range(0, cut) if rank == 0 else range(cut, self.num_layers)

    def mirrored(self, rank: int, cut: int) -> range:
        """The shared layers stage `rank` runs at `cut`: their new K/V rows go to the other stage."""
        return range(self.lo, cut) if rank == 0 else range(cut, self.hi)


class CutChooser:
    """Stage 0's choice of cut per micro-batch, learnt from the stage times measured so far.

    From one micro-batch's two stage times the cut that would have balanced it is about
    `cut + (stage1 - stage0) / (2 * layer)` (moving a layer moves one layer's time). That ideal cut is
    fitted against the micro-batch's sampled rows per token, the share that decides how much the head weighs
    against the layers (about 1 in a decode batch, a few percent in a prefill chunk), and a new micro-batch gets
    the fitted cut for its share. Measuring the cut directly, rather than modelling a layer's and the head's
    cost, also absorbs what no model here knows: one core being slower than the other, the mirror's copies.
    `policy="cycle"` walks through every cut in turn instead: a test uses it to show that the outputs do not
    depend on where the micro-batches are cut."""

    def __init__(self, boundary: FlexBoundary, policy: str = "balance") -> None:
        if policy not in ("balance", "cycle"):
            raise ValueError(f"unknown flex policy {policy!r}; use balance or cycle")
        self.b, self.policy = boundary, policy
        self._n = 0
        self._next = 0
        self._carry = 0.0  # rounding error carried to the next cut
        # Decayed sums of the fit of the ideal cut (y) against sampled rows per token (x).
        self._s1 = self._sx = self._sxx = self._sy = self._sxy = 0.0

    def choose(self, tokens: int, samples: int) -> int:
        if self.policy == "cycle":
            self._next += 1
            return self.b.lo + self._next % (self.b.hi - self.b.lo + 1)
        if self._n < WARMUP_OBSERVATIONS or tokens == 0:
            return self.b.base
        # Error diffusion: an ideal cut of 18.5 becomes 18, 19, 18, 19... Stage 0's micro-batch t+1 runs beside
        # stage 1's t, so a cut alternating around the ideal balances each pair, where always 18 or always 19
        # would leave one stage waiting a layer's time on every micro-batch.
        want = self.predict(samples / tokens) + self._carry
        cut = min(max(round(want), self.b.lo), self.b.hi)
        self._carry = min(max(want - cut, -0.5), 0.5)
        return cut

    def predict(self, share: float) -> float:
        """The fitted ideal cut at `share` sampled rows per token (a straight line; its mean when every batch so
        far had about the same share)."""
        mean_x, mean_y = self._sx / self._s1, self._sy / self._s1
        var = self._sxx / self._s1 - mean_x * mean_x
        if var < 1e-4:
            return mean_y
        slope = (self._sxy / self._s1 - mean_x * mean_y) / var
        return mean_y + slope * (share - mean_x)

    def observe(
        self, tokens: int, samples: int, cut: int, stage0_s: float, stage1_s: float, layer_s: float | None = None
    ) -> None:
        """One micro-batch's measured times: stage 0 ran `cut` layers (and the embedding), stage 1 the rest
        and the head. `layer_s`, a layer's time when the stage times include more than the model (default: stage
        0's time over its layers)."""
        if tokens == 0 or cut == 0 or stage0_s <= 0:
            return
        layer_s = layer_s if layer_s and layer_s > 0 else stage0_s / cut
        ideal = cut + (stage1_s - stage0_s) / (2 * layer_s)
        # One odd measurement (a page fault storm, a neighbour on the core) must not drag the fit far.
        ideal = min(max(ideal, self.b.lo - self.b.k), self.b.hi + self.b.k)
        x, d = samples / tokens, DECAY
        self._s1, self._sx, self._sxx = d * self._s1 + 1, d * self._sx + x, d * self._sxx + x * x
        self._sy, self._sxy = d * self._sy + ideal, d * self._sxy + x * ideal
        self._n += 1
