"""Steps 1 and 2 of the ring loop: requests and aborts in, and the batch plan every stage applies.

A mixin of `StageLoop` (its attributes: `cfg`, `stage`, `io`, `planner`, `blocks`, `sampler`, `flex`, `gc`,
`times`, `stopping`, `pending_outputs`, `next_output`; its methods `drain` and `maybe_report`), kept apart so
that the loop's file holds the step and the compute. Stage 0 decides every plan; the others receive it, check
its sequence number before anything else and forward it, so all stages apply the same plans in the same order.
"""

from __future__ import annotations

import time

from ringsched.comm.messages import AbortRequest, BatchPlan, NewRequest, OutputBatch, Shutdown
from ringsched.comm.tensor_channel import SequenceMismatch


class PlanFlow:
    def next_plan(self, t: int) -> BatchPlan | None:
        if self.stage.is_first:
            return self.make_plan(t)
        start = time.perf_counter()
        while True:
            plan = self.io.plan_in.recv(timeout_ms=200)
            if plan is not None:
                break
            if self.stage.is_last and self.pending_outputs:
                self.drain(t)  # the ring went quiet: stage 0 is waiting for these
            self.gc.idle()
            self.io.alive()
            self.maybe_report()
        waited = time.perf_counter() - start
        # A long wait with an empty pipeline is idleness, not a bubble.
        if waited > 0.1:
            self.times.idle += waited
        else:
            self.times.wait_prev += waited
        if not plan.shutdown and plan.seq != t:
            raise SequenceMismatch(f"stage {self.stage.rank} expected plan {t}, got {plan.seq}")
        if self.io.plan_out:
            start = time.perf_counter()
            self.io.plan_out.send(plan)
            self.times.comm += time.perf_counter() - start
        return plan

    def make_plan(self, t: int) -> BatchPlan | None:
        self.take_in(timeout_ms=0)
        if not self.planner.has_work and self.next_output < t:
            self.drain(t)  # outputs still on their way back (async depth, or the ring's lag)
            return None
        if self.stopping and not self.planner.has_work:
            plan = BatchPlan(slot=t % self.cfg.pp_loop_size, seq=t, shutdown=True)
        elif not self.planner.has_work:
            start = time.perf_counter()
            self.take_in(timeout_ms=100)
            self.gc.idle()
            self.times.idle += time.perf_counter() - start
            self.io.alive()
            return None
        else:
            start = time.perf_counter()
            plan = self.planner.plan(t % self.cfg.pp_loop_size, t)
            self.times.sched += time.perf_counter() - start
        if self.flex and not plan.shutdown:
            self.flex.choose(plan)
        if self.io.plan_out:
            start = time.perf_counter()
            self.io.plan_out.send(plan)
            self.times.comm += time.perf_counter() - start
        return plan

    def take_in(self, timeout_ms: int) -> None:
        msgs = self.io.front_in.drain()
        if not msgs and timeout_ms:
            first = self.io.front_in.recv(timeout_ms=timeout_ms)
            msgs = [first] if first is not None else []
        errors = []
        for m in msgs:
            if isinstance(m, NewRequest):
                err = self.planner.add(m)
                if err:
                    errors.append(err)
            elif isinstance(m, AbortRequest):
                out = self.planner.abort(m.rid)
                if out:
                    errors.append(out)
            elif isinstance(m, Shutdown):
                # Stop now: everything still queued or running ends as aborted; in-flight batches drain.
                self.stopping = True
                for rid in list(self.planner.requests):
                    out = self.planner.abort(rid)
                    if out:
                        errors.append(out)
        if errors:
            self.io.front_out.send(OutputBatch(errors))

    def apply(self, plan: BatchPlan) -> None:
        if not self.stage.is_first:  # stage 0's planner already did this
            for rid in plan.frees:
                self.blocks.free(rid)
            for e in plan.entries:
                if e.new_blocks:
                    self.blocks.assign(e.rid, e.new_blocks)
        if self.sampler:
            self.sampler.apply(plan)
