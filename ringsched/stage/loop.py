"""The ring loop every stage runs, one micro-batch slot after another.

For micro-batch `t` in slot `t % pp_loop_size`, every stage runs the same steps (after SGLang's
`event_loop_pp`):

1. take in new requests and aborts (stage 0, from the front end);
2. stage 0 plans micro-batch `t` and sends the plan on; the others receive it, check its sequence number and
   forward it;
3. non-first stages receive the `"proxy"` tensors of `t`;
4. run this stage's layers (the last stage also samples);
5. non-last stages post the `"proxy"` send of `t` (async; posted before step 6 so the next stage can start
   while this one waits);
6. the output exchange: the last stage sends the sampled tokens of `t - max(depth - 1, 0)`, stage 0
   receives those of `t - pp_loop_size + 1` and updates its requests.

Stage 0 receives the results of a slot's previous micro-batch just before it plans that slot again, so a
request is in at most one in-flight micro-batch and no stage waits in a full pipeline.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ringsched.attention.backend import AttentionBackend, select_backend
from ringsched.comm.messages import BatchPlan, OutputBatch
from ringsched.comm.tensor_channel import SequenceMismatch, TensorChannel, without_source_paths
from ringsched.comm.zmq_io import Fanout, Puller, Pusher
from ringsched.config import EngineConfig
from ringsched.kv.cache import BlockTable, KVPool
from ringsched.layout.flex import FlexBoundary
from ringsched.layout.rank import Layout, RankInfo, StageInfo, rank_infos
from ringsched.models.llama import StageModel
from ringsched.models.tp import TPGroup
from ringsched.sampling.structured import Grammars
from ringsched.scheduler.planner import Planner
from ringsched.stage.flex_ring import FixedCut, FlexRing
from ringsched.stage.gc_policy import GcPolicy
from ringsched.stage.outputs import outputs_for
from ringsched.stage.plans import FollowPlans, LeadPlans
from ringsched.stage.profiler import ProfileWindow, StepProfiler
from ringsched.stage.sampler_state import SamplerState
from ringsched.stage.seams import Embed, HoldTokens, PassOn, ReceiveProxy, SamplingHead, SendProxy
from ringsched.stage.static_batches import NO_BUCKETS, Buckets, EagerForward, StaticForward
from ringsched.stage.static_batches import buckets as static_buckets
from ringsched.stage.times import StageTimes, peak_rss_bytes

logger = logging.getLogger(__name__)


class PeerLost(RuntimeError):
    pass


@dataclass
class StageIO:
    seam: TensorChannel  # the seams forward (the ranks' process group: gloo on CPU, NCCL on GPUs)
    back: TensorChannel | None  # the sampled tokens back to stage 0 (gloo; on GPUs a group of their own, `groups.py`)
    plan_in: Puller | None  # from the previous stage (non-first)
    plan_out: Pusher | Fanout | None  # to the next stage (non-last) and the stage's other ranks (its first rank)
    front_in: Puller | None  # stage 0: new requests and aborts
    front_out: Pusher | None  # stage 0: outputs for the front end
    alive: Callable[[], None]  # raises when this process should stop (parent gone)
    report: Callable[[dict], None]  # per-stage stats to the launcher
    progress_in: Puller | None = None  # stage 0, --pp-flex-policy ready: stage 1's StageProgress
    progress_out: Pusher | None = None  # stage 1, likewise


class StageLoop:
    """One stage's loop. Its parts are chosen once, from its place in the ring: where plans come from (`plans`),
    what comes in at its first seam (`inbound`), what its layers' output becomes (`head`) and where it goes
    (`outbound`), the tokens' way back (`outputs`), and the cut between two stages (`cut`: fixed, or
    `--pp-flex-layers`). `where` places the rank (default: the only rank of `stage`); with `tp`, one of the
    stage's tensor-parallel ranks: stage 0's first rank plans, each stage's first rank passes plans on, the last
    stage's first rank sends the tokens back, and seam tensors travel between ranks of the same TP index."""

    def __init__(
        self,
        cfg: EngineConfig,
        stage: StageInfo,
        model: StageModel,
        blocks: BlockTable,
        pool: KVPool,
        io: StageIO,
        planner: Planner | None,
        device: torch.device,
        eos_ids: tuple[int, ...] = (),
        flex: FlexBoundary | None = None,
        where: RankInfo | None = None,
        tp: TPGroup | None = None,
        attention: AttentionBackend | None = None,
        static: tuple[int, int] | None = None,
    ) -> None:
        self.cfg, self.stage, self.model, self.blocks, self.pool, self.io = cfg, stage, model, blocks, pool, io
        self.where = where or rank_infos(Layout(stage.size), [1] * stage.size)[stage.rank]
        self.tp = tp
        self.planner, self.device = planner, device
        # How the layers attend, chosen once: `--attention-backend` (auto: the CPU decode kernel where it applies,
        # Triton on CUDA), or the stage's context-parallel attention (`attention/cp_backend.py`).
        kv_dtype = pool.caches[0][0].dtype if pool.caches else torch.float32
        self.attention = attention or select_backend(cfg.attention_backend, device, kv_dtype)
        self.times = StageTimes(cuda=torch.device(device).type == "cuda")
        self.gc = GcPolicy()
        window = ProfileWindow.from_env()  # RINGSCHED_TORCH_PROFILER_DIR: a debugging aid, off by default
        self.profiler = StepProfiler(window, stage.rank, stage.size) if window else None
        self._last_stats = 0.0
        # Read by the heartbeat thread (stage/worker.py): micro-batches done, and whether one is under way now.
        self.steps = 0
        self.in_step = False
        self._compose(flex, eos_ids, static)

    def _compose(self, flex: FlexBoundary | None, eos_ids: tuple[int, ...], static: tuple[int, int] | None) -> None:
        cfg, stage, io, times, where = self.cfg, self.stage, self.io, self.times, self.where
        self.cut = (
            FlexRing(flex, stage, self.pool.caches, self.device, cfg.pp_flex_policy, io.progress_in, io.progress_out)
            if flex
            else FixedCut(stage, self.device)
        )
        prev, next_ = where.pp_group[stage.prev], where.pp_group[stage.next]  # the same TP index, next door
        # The forward pass: eager, or decode steps on static buffers (`static`: the scratch block the pool set aside
        # for their padding rows, and the context length)
        self.forward = EagerForward(self.model, self.attention, self.blocks, self.pool, self.cut, self.device)
        buckets = NO_BUCKETS
        if static is not None:
            self.forward = StaticForward(self.forward, *static)
            buckets = Buckets(static_buckets(cfg.cuda_graph_max_bs))
        self.outputs = outputs_for(cfg, where, io.back, times, self.peer, self.planner, io.front_out, self.cut)
        if where.decides:
            self.plans = LeadPlans(cfg, io, self.planner, times, self.gc, self.cut, self.outputs, buckets)
        else:
            self.plans = FollowPlans(where, io, self.blocks, times, self.gc, self.outputs, self.maybe_report)
        # Where the cut and the backend let the plan give each seam's shape, it travels unframed
        known = cfg.torch_dtype if self.cut.seam_from_plan and self.attention.seam_from_plan else None
        if stage.is_first:
            self.inbound = Embed()
        else:
            hidden = self.model.cfg.hidden_size
            self.inbound = ReceiveProxy(prev, io.seam, times, self.peer, self.tp, hidden, known)
        if stage.is_last:
            # Under CP the group's first rank samples every row (the others send it theirs).
            grammars = Grammars(cfg.model, self.model.cfg.vocab_size, eos_ids)
            sampler = SamplerState(self.device, eos_ids, grammars)
            self.head = SamplingHead(self.model, sampler, times, self.cut, active=self.attention.samples_here)
            self.outbound = HoldTokens(self.cut, self.outputs, times)
        else:
            self.head, self.outbound = PassOn(), SendProxy(next_, io.seam, times, self.peer, self.tp, known)

    def run(self) -> None:
        self.gc.start()
        try:
            self._run()
        finally:
            self.gc.stop()

    def _run(self) -> None:
        t = 0
        spent_before = 0.0  # sched + comm seconds at the end of the previous step (a flexible cut learns them)
        while True:
            self.maybe_report()
            self.io.alive()  # a busy stage must notice an orphaned ring too (one getppid() per micro-batch)
            plan = self.plans.next(t)
            if plan is None:
                continue
            if plan.shutdown:
                return
            self.in_step = True
            self.step(plan)
            self.in_step = False
            self.steps += 1
            if self.profiler:
                self.profiler.after_step(plan.num_tokens, self.times)
            with self.times.measure("sched"):
                self.gc.after_step()
            spent = self.times.sched + self.times.comm
            self.cut.note_overhead(spent - spent_before)
            spent_before = spent
            t += 1

    def step(self, plan: BatchPlan) -> None:
        """One micro-batch, the plan already taken in (steps 1-2): apply it, then steps 3 to 6."""
        self.apply(plan)
        inputs = self.inbound.receive(plan)  # 3. the previous stage's proxy (none on the first stage)
        out = self.compute(plan, inputs)  # 4. this stage's layers, and on the last stage the head
        self.outbound.send(plan, out)  # 5. the proxy to the next stage, or the tokens held to go back
        self.outputs.exchange(plan.seq)  # 6. the tokens' way back to stage 0

    def apply(self, plan: BatchPlan) -> None:
        with self.times.measure("sched"):
            self.plans.apply(plan)
            self.attention.apply(plan)
            self.head.apply(plan)

    def peer(self, peer: int, fn, *args):
        """Run a tensor-channel call; a dead or unreachable neighbour becomes an error that names it."""
        try:
            return fn(*args)
        except SequenceMismatch:
            raise
        except RuntimeError as e:
            here, there = self.cfg.describe_rank(self.where.rank), self.cfg.describe_rank(peer)
            raise PeerLost(f"{here} lost {there}: {without_source_paths(str(e).splitlines()[0])}") from e

    @torch.inference_mode()
    def compute(self, plan: BatchPlan, proxy: dict | None):
        """The layers this stage runs for `plan` (the cut may choose them), then its head; the output for the
        next stage (a dict of tensors) or, on the last stage, the sampled tokens."""
        if not plan.entries:
            return self.head.empty()
        with self.times.measure("compute") as took:
            batch, out, rows = self.forward(plan, proxy)
            out = self.head(plan, out, rows)
        layers_run = self.cut.computed(plan, took.seconds, batch.slot_mapping, rows)
        self.plans.computed(plan, took.seconds)
        self.times.count(batch.num_tokens, layers_run)
        return out

    def stage_stats(self) -> dict:
        on_gpu = torch.device(self.device).type == "cuda"
        return {
            "rank": self.where.rank,
            "stage": self.stage.rank,
            "tp": self.where.tp,
            "cp": self.where.cp,
            "kv_usage": self.blocks.usage,
            "kv_used_blocks": self.blocks.used_blocks,
            "peak_rss_bytes": peak_rss_bytes(),
            "peak_device_bytes": torch.cuda.max_memory_allocated(self.device) if on_gpu else 0,
            **self.times.snapshot(),
            **self.cut.stats(),
            **self.io.seam.stats(),
            "output_bytes_sent": self.io.back.stats().get("output_bytes_sent", 0) if self.io.back else 0,
            "seam_tokens_sent": getattr(self.outbound, "tokens", 0),
            **(self.tp.stats() if self.tp else {}),
            **self.attention.stats(),
            **self.forward.stats(),
        }

    def maybe_report(self, period: float = 0.5) -> None:
        """Now and then: this stage's stats to the launcher; stage 0 adds the scheduler's to the front end."""
        now = time.perf_counter()
        if now - self._last_stats < period:
            return
        self._last_stats = now
        stats = self.stage_stats()
        self.io.report(stats)
        if self.planner is not None:
            self.io.front_out.send(OutputBatch([], {**self.planner.stats(), **stats}))
