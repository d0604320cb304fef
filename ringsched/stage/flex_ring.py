"""A stage's side of the flexible cut (`--pp-flex-layers`, `layout/flex.py`): which layers a micro-batch runs
here, the K/V rows mirrored to and from the other stage, and (stage 0) the cut of each new micro-batch.

Wire format, PP=2 only: the proxy of micro-batch `t` is `[hidden_states, residual, kv?]`, `kv` being the K/V
rows of the shared layers stage 0 ran (`[lo, cut)`, `gather_kv`'s one tensor, absent when there are none);
the output message is `[meta, tokens?, kv?]` with `meta` = `[number of sampled tokens, stage 1's time for the
micro-batch in microseconds]`, the tokens when there are any, and the K/V rows of the shared layers stage 1 ran
(`[cut, hi)`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ringsched.comm.messages import BatchPlan
from ringsched.comm.zmq_io import Puller, Pusher
from ringsched.layout.flex import CutChooser, FlexBoundary
from ringsched.layout.rank import StageInfo
from ringsched.stage.flex_ready import ProgressReporter, ReadyCut

# Memory of the per-micro-batch overhead's average (about 20 micro-batches).
OVERHEAD_DECAY = 0.95


@dataclass
class _Sent:
    """Stage 0's record of a micro-batch in flight, for when its outputs come back."""

    tokens: int
    samples: int
    cut: int
    compute_s: float
    overhead_s: float
    slots: torch.Tensor


class FixedCut:
    """The cut strategy without `--pp-flex-layers`: the partition's layers, nothing mirrored, the sampled tokens
    alone on the way back. `FlexRing` has the same methods; the stage and its parts call them without asking which:

    - stage 0 plans: `choose` a plan's cut; `note_overhead` of a step; `tokens_of` an output message;
    - every stage computes: the `layers` a plan runs here (taking in what the proxy brings), the K/V rows to send
      `after_layers`, what it `computed` (the layers it ran);
    - the last stage answers: `head_took`, the output message's `payload`;
    - `stats`."""

    seam_from_plan = True  # the seam is the layers' output alone: its shape follows from the plan

    def __init__(self, stage: StageInfo, device: torch.device) -> None:
        self.stage, self.device = stage, device

    def choose(self, plan: BatchPlan) -> None:
        pass

    def layers(
        self, plan: BatchPlan, one_call: bool = False, proxy: dict | None = None, slots: torch.Tensor | None = None
    ) -> Iterator[int] | range | None:
        return None  # all of this stage's layers

    def after_layers(self, plan: BatchPlan, slots: torch.Tensor) -> list[torch.Tensor]:
        return []

    def head_took(self, rows: int, seconds: float) -> None:
        pass

    def computed(self, plan: BatchPlan, seconds: float, slots: torch.Tensor, rows: list[torch.Tensor]) -> int:
        """The layers the plan ran here."""
        return self.stage.num_layers

    def payload(self, plan: BatchPlan, tokens: torch.Tensor) -> list[torch.Tensor]:
        """Last stage: the output message of `plan`, on the host (the tokens' way back is a gloo group). From a GPU, a
        copy into pinned memory the step only enqueues (`outputs._Holding` waits for it before it sends)."""
        if not tokens.numel():
            return []
        return [tokens.to("cpu", non_blocking=True)]

    def tokens_of(self, seq: int, tensors: list[torch.Tensor]) -> torch.Tensor:
        """Stage 0: the sampled tokens in an output message."""
        return tensors[0] if tensors else torch.empty(0, dtype=torch.long)

    def note_overhead(self, seconds: float) -> None:
        pass

    def stats(self) -> dict:
        return {}


class FlexRing:
    seam_from_plan = False  # the seam carries the shared layers' K/V rows too, as many as the cut mirrors

    def __init__(
        self,
        boundary: FlexBoundary,
        stage: StageInfo,
        caches: list[tuple[torch.Tensor, torch.Tensor]],
        device: torch.device,
        policy: str = "balance",
        progress_in: Puller | None = None,
        progress_out: Pusher | None = None,
    ) -> None:
        self.b, self.stage, self.caches, self.device = boundary, stage, caches, device
        ready = policy == "ready"
        if ready and (progress_in if stage.is_first else progress_out) is None:
            raise ValueError("--pp-flex-policy ready needs the channel for stage 1's progress")
        self.chooser = CutChooser(boundary, policy) if stage.is_first and not ready else None
        self.ready_cut = ReadyCut(boundary, progress_in) if ready and stage.is_first else None
        self.reporter = ProgressReporter(progress_out) if ready and not stage.is_first else None
        self._sent: dict[int, _Sent] = {}
        self._out: dict[int, tuple[float, list[torch.Tensor]]] = {}  # stage 1: (seconds, K/V rows) per micro-batch
        self.cuts: dict[int, int] = {}  # how often each cut was used (stats, tests)
        self._overhead = 0.0  # this stage's mean time per micro-batch outside the model
        self._noted = False

    def note_overhead(self, seconds: float) -> None:
        """One step's time outside the model and its waits: planning, posting sends, delivering outputs.

        Why the chooser counts it: the ring's pace is each stage's whole time per micro-batch, not its model
        compute, and stage 0 also plans, relays and hands every sampled token to the front end. In the offline
        benchmark that is ~4 ms of a ~350 ms SmolLM2 step and counting it measured neutral; it weighs more where
        that share is larger, as with a smaller model beside the same per-request work."""
        if self._noted:
            self._overhead = OVERHEAD_DECAY * self._overhead + (1 - OVERHEAD_DECAY) * seconds
        else:  # the first step sets it: an average started from 0 would under-count the first ~20
            self._overhead, self._noted = seconds, True

    # -- stage 0 ------------------------------------------------------------------------------------------
    def choose(self, plan: BatchPlan) -> None:
        """Before the plan leaves: `balance` and `cycle` set its cut; `ready` leaves it to the forward pass."""
        if plan.entries and self.chooser is not None:
            plan.cut = min(self.chooser.choose(plan.num_tokens, plan.sample_rows), self._cap(plan))

    def _cap(self, plan: BatchPlan) -> int:
        """The latest cut `plan` may take on stage 0: no later than the in-flight micro-batches whose KV it reads
        (stage 0 holds their shared layers' KV up to their cut until their outputs come back)."""
        return min((self._sent[s].cut for s in plan.reads if s in self._sent), default=self.b.hi)

    def sent(self, plan: BatchPlan, compute_s: float, slots: torch.Tensor) -> None:
        self.cuts[plan.cut] = self.cuts.get(plan.cut, 0) + 1
        self._sent[plan.seq] = _Sent(plan.num_tokens, plan.sample_rows, plan.cut, compute_s, self._overhead, slots)

    def on_output(self, seq: int, tensors: list[torch.Tensor]) -> torch.Tensor:
        """Stage 0: take one output message apart; mirror stage 1's K/V rows and learn from its time. Returns
        the sampled tokens."""
        meta = tensors[0].cpu()
        n, stage1_us = int(meta[0]), int(meta[1])
        tokens = tensors[1].cpu() if n else torch.empty(0, dtype=torch.long)
        rows = tensors[1 + (1 if n else 0) :]
        sent = self._sent.pop(seq, None)
        if sent is None:  # an empty micro-batch: nothing ran
            return tokens
        scatter_kv(self.caches, self.stage.start_layer, self.b.mirrored(1, sent.cut), sent.slots, rows)
        if self.chooser is None:
            return tokens
        self.chooser.observe(
            sent.tokens,
            sent.samples,
            sent.cut,
            sent.compute_s + sent.overhead_s,
            stage1_us / 1e6,
            layer_s=sent.compute_s / sent.cut,  # cut >= lo >= 1: FlexBoundary keeps a layer on each stage
        )
        return tokens

    # -- stage 1 --------------------------------------------------------------------------------------------
    def take_cut(self, plan: BatchPlan, rows: list[torch.Tensor]) -> None:
        """Stage 1: the cut of this micro-batch, from the K/V rows stage 0 sent (layers `[lo, cut)`); the plan's
        own cut, when stage 0 chose it in advance, must agree."""
        cut = self.b.lo + (rows[0].shape[0] // 2 if len(rows) == 1 else 0)
        if plan.cut >= 0 and plan.cut != cut:
            raise RuntimeError(f"micro-batch {plan.seq}: the plan cuts at layer {plan.cut}, the proxy at {cut}")
        plan.cut = cut

    def head_took(self, rows: int, seconds: float) -> None:
        """Stage 1: the head's time for this micro-batch's sampled rows (policy `ready` forecasts with it)."""
        if self.reporter:
            self.reporter.head_took(rows, seconds)

    def done(self, plan: BatchPlan) -> None:
        """Stage 1: this micro-batch is computed (policy `ready`: stage 0 may cut the next one)."""
        if self.reporter:
            self.reporter.done(plan)

    # -- both -----------------------------------------------------------------------------------------------
    def layers(
        self, plan: BatchPlan, one_call: bool = False, proxy: dict | None = None, slots: torch.Tensor | None = None
    ) -> Iterator[int] | range:
        """The layers this stage runs for `plan`, in order: a range when the cut is known before they run (the
        model may then run them in one native call), else an iterator (policy `ready`: stage 0 sets `plan.cut`
        once the last one has been asked for). `one_call`: the step can take the one-call decode layers, so
        `ready` does not decide as it goes: stage 0 cuts at the base cut (a step of a few decodes is short, and
        a ring holding few requests gains little from moving its cut), stage 1 sends no forecast for it. Stage 1
        first learns the cut from the K/V rows stage 0 sent in the `proxy` and writes them at `slots`."""
        if proxy is not None:
            self.take_cut(plan, proxy["kv"])
            self.mirror_in(plan, proxy["kv"], slots)
        if self.ready_cut:
            if not one_call:
                return self.ready_cut.layers(plan, self._cap(plan))
            plan.cut = min(self.b.base, self._cap(plan))
        run = self.b.run_range(self.stage.rank, plan.cut)
        return self.reporter.layers(plan, run) if self.reporter and not one_call else run

    def mirror_in(self, plan: BatchPlan, rows: list[torch.Tensor], slots: torch.Tensor) -> None:
        """Stage 1: write the K/V rows stage 0 ran for this micro-batch's shared layers."""
        scatter_kv(self.caches, self.stage.start_layer, self.b.mirrored(0, plan.cut), slots, rows)

    def mirror_out(self, plan: BatchPlan, slots: torch.Tensor) -> list[torch.Tensor]:
        """The K/V rows this stage ran for the shared layers, to send to the other stage."""
        return gather_kv(self.caches, self.stage.start_layer, self.b.mirrored(self.stage.rank, plan.cut), slots)

    def output_payload(self, tokens: torch.Tensor, compute_s: float, rows: list[torch.Tensor]) -> list[torch.Tensor]:
        """Stage 1: the output message of one micro-batch (see the module doc)."""
        spent_us = int((compute_s + self._overhead) * 1e6)
        meta = torch.tensor([tokens.numel(), spent_us], dtype=torch.long, device=self.device)
        return [meta] + ([tokens.to(self.device)] if tokens.numel() else []) + rows

    # -- the cut strategy, as the stage calls it (see FixedCut) ---------------------------------------------
    def after_layers(self, plan: BatchPlan, slots: torch.Tensor) -> list[torch.Tensor]:
        return self.mirror_out(plan, slots)

    def computed(self, plan: BatchPlan, seconds: float, slots: torch.Tensor, rows: list[torch.Tensor]) -> int:
        """Stage 0: remember the micro-batch for when its outputs return; stage 1: its time and K/V rows go
        back with its tokens. The layers the plan ran here."""
        if self.stage.is_first:
            self.sent(plan, seconds, slots)
        else:
            self._out[plan.seq] = (seconds, rows)
        return len(self.b.run_range(self.stage.rank, plan.cut))

    def payload(self, plan: BatchPlan, tokens: torch.Tensor) -> list[torch.Tensor]:
        """Stage 1, its micro-batch done (policy `ready`: stage 0 may cut the next one): the output message."""
        self.done(plan)
        return self.output_payload(tokens, *self._out.pop(plan.seq, (0.0, [])))

    def tokens_of(self, seq: int, tensors: list[torch.Tensor]) -> torch.Tensor:
        return self.on_output(seq, tensors)

    def stats(self) -> dict:
        """Stage 0: how many micro-batches were cut where (msgpack keys are strings)."""
        return {"flex_cuts": {str(c): n for c, n in sorted(self.cuts.items())}} if self.stage.is_first else {}


def gather_kv(
    caches: list[tuple[torch.Tensor, torch.Tensor]], first_held: int, layers: range, slots: torch.Tensor
) -> list[torch.Tensor]:
    """The K and V rows just written at `slots` for `layers`, as one tensor `[2 * layers, T, heads, dim]` (K, V
    per layer, in layer order), or no tensor when `layers` is empty."""
    if not len(layers):
        return []
    k0 = caches[layers[0] - first_held][0]
    out = k0.new_empty((2 * len(layers), slots.numel(), *k0.shape[1:]))
    for j, i in enumerate(layers):
        k, v = caches[i - first_held]
        torch.index_select(k, 0, slots, out=out[2 * j])
        torch.index_select(v, 0, slots, out=out[2 * j + 1])
    return [out]


def scatter_kv(
    caches: list[tuple[torch.Tensor, torch.Tensor]],
    first_held: int,
    layers: range,
    slots: torch.Tensor,
    rows: list[torch.Tensor],
) -> None:
    """Write the other stage's K/V rows (`gather_kv`'s output) into this stage's cache."""
    got = rows[0].shape[0] // 2 if len(rows) == 1 else 0
    if len(rows) > 1 or got != len(layers):
        raise RuntimeError(f"expected K/V rows for {len(layers)} shared layers, got {got} in {len(rows)} tensors")
    for j, i in enumerate(layers):
        k, v = caches[i - first_held]
        k.index_copy_(0, slots, rows[0][2 * j].to(k.device))
        v.index_copy_(0, slots, rows[0][2 * j + 1].to(v.device))
