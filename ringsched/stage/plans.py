"""Steps 1 and 2 of the ring loop: requests and aborts in, and the batch plan every stage applies.

Stage 0 decides every plan (`LeadPlans`: it takes in the front end's requests and aborts, plans with the
`Planner`, and sends the plan on before computing it); the other stages receive it, check its sequence number
before anything else, forward it and apply its frees and block numbers (`FollowPlans`), so all stages apply the
same plans in the same order. Within a stage of several tensor-parallel ranks, the first rank passes each plan
to the others as it forwards it. `next(t)` returns micro-batch `t`'s plan, or None when there is nothing to do.
"""

from __future__ import annotations

from collections.abc import Callable

from ringsched.comm.messages import AbortRequest, BatchPlan, NewRequest, OutputBatch, Shutdown
from ringsched.comm.tensor_channel import SequenceMismatch
from ringsched.config import EngineConfig
from ringsched.kv.cache import BlockTable
from ringsched.layout.rank import RankInfo
from ringsched.scheduler.planner import Planner
from ringsched.stage.flex_ring import FixedCut, FlexRing
from ringsched.stage.gc_policy import GcPolicy
from ringsched.stage.static_batches import NO_BUCKETS, Buckets
from ringsched.stage.times import StageTimes


class LeadPlans:
    def __init__(
        self,
        cfg: EngineConfig,
        io,
        planner: Planner,
        times: StageTimes,
        gc: GcPolicy,
        cut: FixedCut | FlexRing,
        outputs,
        buckets: Buckets = NO_BUCKETS,
    ) -> None:
        self.cfg, self.io, self.planner, self.times, self.gc = cfg, io, planner, times, gc
        self.cut, self.outputs, self.buckets = cut, outputs, buckets
        self.stopping = False

    def next(self, t: int) -> BatchPlan | None:
        self.take_in(timeout_ms=0)
        if not self.planner.has_work and self.outputs.behind(t):
            self.outputs.drain(t)  # outputs still on their way back (async depth, or the ring's lag)
            return None
        if self.stopping and not self.planner.has_work:
            plan = BatchPlan(slot=t % self.cfg.pp_loop_size, seq=t, shutdown=True)
        elif not self.planner.has_work:
            with self.times.measure("idle"):
                self.take_in(timeout_ms=100)
                self.gc.idle()
            self.io.alive()
            return None
        else:
            with self.times.measure("sched"):
                plan = self.planner.plan(t % self.cfg.pp_loop_size, t)
                self.buckets.choose(plan)  # static buffers (CUDA graphs) or eager: decided here, for every stage
            self.cut.choose(plan)
        if self.io.plan_out:
            with self.times.measure("comm"):
                self.io.plan_out.send(plan)
        return plan

    def take_in(self, timeout_ms: int) -> None:
        msgs = self.io.front_in.drain()
        if not msgs and timeout_ms:
            first = self.io.front_in.recv(timeout_ms=timeout_ms)
            msgs = [first] if first is not None else []
        errors = []
        for m in msgs:
            if isinstance(m, NewRequest):
                errors.append(self.planner.add(m))
            elif isinstance(m, AbortRequest):
                errors.append(self.planner.abort(m.rid))
            elif isinstance(m, Shutdown):
                # Stop now: everything still queued or running ends as aborted; in-flight batches drain.
                self.stopping = True
                errors += [self.planner.abort(rid) for rid in list(self.planner.requests)]
        errors = [e for e in errors if e]
        if errors:
            self.io.front_out.send(OutputBatch(errors))

    def apply(self, plan: BatchPlan) -> None:
        pass  # the planner already did, as it planned

    def computed(self, plan: BatchPlan, seconds: float) -> None:
        """This stage computed `plan` in `seconds`: what a step of its rows costs (speculative drafts weigh by it)."""
        self.planner.step_took(plan.num_tokens, seconds)


class FollowPlans:
    def __init__(
        self,
        where: RankInfo,
        io,
        blocks: BlockTable,
        times: StageTimes,
        gc: GcPolicy,
        outputs,
        report: Callable[[], None],
    ) -> None:
        self.where, self.io, self.blocks, self.times, self.gc = where, io, blocks, times, gc
        self.outputs, self.report = outputs, report

    def next(self, t: int) -> BatchPlan:
        with self.times.measure("idle") as took:
            while (plan := self.io.plan_in.recv(timeout_ms=200)) is None:
                if self.outputs.pending:
                    self.outputs.drain(t)  # the ring went quiet: stage 0 is waiting for these
                self.gc.idle()
                self.io.alive()
                self.report()
        if took.seconds <= 0.1:  # a short wait in a running ring is a bubble, not idleness
            self.times.idle -= took.seconds
            self.times.wait_prev += took.seconds
        if not plan.shutdown and plan.seq != t:
            raise SequenceMismatch(f"rank {self.where.rank} (stage {self.where.pp}) expected plan {t}, got {plan.seq}")
        if self.io.plan_out:
            with self.times.measure("comm"):
                self.io.plan_out.send(plan)
        return plan

    def apply(self, plan: BatchPlan) -> None:
        for rid in plan.frees:
            self.blocks.free(rid)
        for e in plan.entries:
            self.blocks.follow(e, self.where.cp)

    def computed(self, plan: BatchPlan, seconds: float) -> None:
        pass
