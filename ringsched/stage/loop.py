"""The ring loop every stage runs, one micro-batch slot after another.

For micro-batch `t` in slot `t % pp_loop_size`, every stage runs the same steps (design brief, "The stage
loop"):

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
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ringsched.comm.messages import BatchPlan, OutputBatch
from ringsched.comm.tensor_channel import SequenceMismatch, TensorChannel, without_source_paths
from ringsched.comm.zmq_io import Puller, Pusher
from ringsched.config import EngineConfig
from ringsched.kv_cache import BlockTable, KVPool
from ringsched.models import native
from ringsched.models.batch import build_forward_batch
from ringsched.models.llama import StageModel
from ringsched.parallel.flex import FlexBoundary
from ringsched.parallel.flex_ring import FlexRing
from ringsched.parallel.rank import StageInfo
from ringsched.scheduler.planner import Planner
from ringsched.stage.gc_policy import GcPolicy
from ringsched.stage.outputs import OutputExchange
from ringsched.stage.plans import PlanFlow
from ringsched.stage.profiler import ProfileWindow, StepProfiler
from ringsched.stage.sampler_state import SamplerState
from ringsched.stage.times import StageTimes, peak_rss_bytes

logger = logging.getLogger(__name__)


class PeerLost(RuntimeError):
    pass


@dataclass
class StageIO:
    chan: TensorChannel
    plan_in: Puller | None  # from the previous stage (non-first)
    plan_out: Pusher | None  # to the next stage (non-last)
    front_in: Puller | None  # stage 0: new requests and aborts
    front_out: Pusher | None  # stage 0: outputs for the front end
    alive: Callable[[], None]  # raises when this process should stop (parent gone)
    report: Callable[[dict], None]  # per-stage stats to the launcher
    progress_in: Puller | None = None  # stage 0, --pp-flex-policy ready: stage 1's StageProgress
    progress_out: Pusher | None = None  # stage 1, likewise


class StageLoop(PlanFlow, OutputExchange):
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
    ) -> None:
        self.cfg, self.stage, self.model, self.blocks, self.pool, self.io = cfg, stage, model, blocks, pool, io
        self.planner, self.device = planner, device
        # Decode attention through the CPU kernel where it applies (float32 or bfloat16 KV on CPU, a C compiler
        # at hand).
        self.use_native_decode = bool(pool.caches) and native.usable_for(pool.caches[0][0].dtype, device)
        self.sampler = SamplerState(device, eos_ids) if stage.is_last else None
        # --pp-flex-layers: the cut moves per micro-batch and the shared layers' K/V are mirrored.
        self.flex = None
        if flex:
            self.flex = FlexRing(flex, stage, pool.caches, device, cfg.pp_flex_policy, io.progress_in, io.progress_out)
        # Last stage: sampled, not yet sent (seq, the message's tensors).
        self.pending_outputs: deque[tuple[int, list[torch.Tensor]]] = deque()
        self.next_output = 0  # stage 0: the micro-batch whose outputs come back next
        self.times = StageTimes()
        self.gc = GcPolicy()
        window = ProfileWindow.from_env()  # RINGSCHED_TORCH_PROFILER_DIR: a debugging aid, off by default
        self.profiler = StepProfiler(window, stage.rank, stage.size) if window else None
        self.stopping = False
        self._last_stats = 0.0
        # Read by the heartbeat thread (stage_worker): micro-batches done, and whether one is under way now.
        self.steps = 0
        self.in_step = False

    def run(self) -> None:
        self.gc.start()
        try:
            self._run()
        finally:
            self.gc.stop()

    def _run(self) -> None:
        t = 0
        spent_before = 0.0  # sched + comm seconds at the end of the previous step (--pp-flex-layers)
        while True:
            self.maybe_report()
            self.io.alive()  # a busy stage must notice an orphaned ring too (one getppid() per micro-batch)
            plan = self.next_plan(t)
            if plan is None:
                continue
            if plan.shutdown:
                if self.io.plan_out:
                    self.io.plan_out.send(plan)
                return
            self.in_step = True
            self.step(plan)
            self.in_step = False
            self.steps += 1
            if self.profiler:
                self.profiler.after_step(plan.num_tokens, self.times)
            start = time.perf_counter()
            self.gc.after_step()
            self.times.sched += time.perf_counter() - start
            if self.flex:
                spent = self.times.sched + self.times.comm
                self.flex.note_overhead(spent - spent_before)
                spent_before = spent
            t += 1

    def step(self, plan: BatchPlan) -> None:
        t, last = plan.seq, self.stage.is_last
        start = time.perf_counter()
        self.apply(plan)
        self.times.sched += time.perf_counter() - start
        proxy = self.recv_proxy(plan) if not self.stage.is_first and plan.entries else None
        out = self.forward(plan, proxy)
        start = time.perf_counter()
        if self.flex and last:
            self.flex.done(plan)
        if not last and plan.entries:
            tensors = [out["hidden_states"], out["residual"], *out.get("kv", [])]
            self._with_peer(self.stage.next, self.io.chan.send, self.stage.next, "proxy", plan.slot, t, tensors)
        if last:
            self.pending_outputs.append((t, self._output_payload(out)))
        peer = 0 if last else self.stage.prev
        waited = self.times.wait_output
        self._with_peer(peer, self.exchange_outputs, t)
        # Time blocked on the returning outputs is a wait, already counted; the rest is communication.
        self.times.comm += time.perf_counter() - start - (self.times.wait_output - waited)

    def _with_peer(self, peer: int, fn, *args):
        """Run a tensor-channel call; a dead or unreachable neighbour becomes an error that names it."""
        try:
            return fn(*args)
        except SequenceMismatch:
            raise
        except RuntimeError as e:
            here, there = self.stage.rank, peer
            if self.cfg.nnodes > 1:
                here, there = f"{here} (node {self.cfg.node_of(here)})", f"{there} (node {self.cfg.node_of(there)})"
            raise PeerLost(f"stage {here} lost stage {there}: {without_source_paths(str(e).splitlines()[0])}") from e

    # -- 3, 4: compute ------------------------------------------------------------------------------------
    def recv_proxy(self, plan: BatchPlan) -> dict[str, torch.Tensor]:
        start = time.perf_counter()
        msg = self._with_peer(self.stage.prev, self.io.chan.recv, self.stage.prev, "proxy", plan.seq)
        self.times.wait_prev += time.perf_counter() - start
        return {"hidden_states": msg.tensors[0], "residual": msg.tensors[1], "kv": msg.tensors[2:]}

    @torch.inference_mode()
    def forward(self, plan: BatchPlan, proxy):
        self._flex_out: tuple[float, list[torch.Tensor]] = (0.0, [])  # last stage: (compute s, K/V rows) for stage 0
        if not plan.entries:
            return torch.empty(0, dtype=torch.long) if self.stage.is_last else None
        start = time.perf_counter()
        batch, ids = build_forward_batch(plan, self.blocks, self.device, self.use_native_decode)
        if self.flex and not self.stage.is_first:
            self.flex.take_cut(plan, proxy["kv"])
            self.flex.mirror_in(plan, proxy["kv"], batch.slot_mapping)
        layers = self.flex.layers(plan) if self.flex else None  # policy ready: sets plan.cut as it runs
        out = self.model(
            batch, input_ids=ids if self.stage.is_first else None, proxy=proxy, kv_caches=self.pool.caches,
            layers=layers,
        )
        mirrored = self.flex.mirror_out(plan, batch.slot_mapping) if self.flex else []
        if not self.stage.is_last:
            out["kv"] = mirrored
        if self.stage.is_last:
            head_start = time.perf_counter()
            if self.sampler.greedy_only(plan):
                out = self.model.greedy_tokens(out).cpu()
            else:
                out = self.sampler.sample(plan, self.model.compute_logits(out)).cpu()
            head_s = time.perf_counter() - head_start
            self.times.head += head_s
            if self.flex:
                self.flex.head_took(plan.num_samples, head_s)
            self.times.sample_rows += out.numel()
        elapsed = time.perf_counter() - start
        self.times.compute += elapsed
        if self.flex and self.stage.is_first:
            self.flex.sent(plan, elapsed, batch.slot_mapping)
        elif self.flex:
            self._flex_out = (elapsed, mirrored)
        self.times.batches += 1
        self.times.tokens += plan.num_tokens
        ran = len(self.flex.b.run_range(self.stage.rank, plan.cut)) if self.flex else self.stage.num_layers
        self.times.layer_tokens += plan.num_tokens * ran
        return out

    def stage_stats(self) -> dict:
        on_gpu = torch.device(self.device).type == "cuda"
        return {
            "rank": self.stage.rank,
            "kv_usage": self.blocks.usage,
            "kv_used_blocks": self.blocks.used_blocks,
            "peak_rss_bytes": peak_rss_bytes(),
            "peak_device_bytes": torch.cuda.max_memory_allocated(self.device) if on_gpu else 0,
            **self.times.snapshot(),
            **self._flex_stats(),
        }

    def _flex_stats(self) -> dict:
        """Stage 0 with a flexible cut: how many micro-batches were cut where (msgpack keys are strings)."""
        if not (self.flex and self.stage.is_first):
            return {}
        return {"flex_cuts": {str(c): n for c, n in sorted(self.flex.cuts.items())}}

    def maybe_report(self, period: float = 0.5) -> None:
        """Now and then: this stage's stats to the launcher; stage 0 adds the scheduler's to the front end."""
        now = time.perf_counter()
        if now - self._last_stats < period:
            return
        self._last_stats = now
        stats = self.stage_stats()
        self.io.report(stats)
        if self.stage.is_first:
            self.io.front_out.send(OutputBatch([], {**self.planner.stats(), **stats}))
