"""Stage 0's scheduler: it alone decides what each micro-batch holds.

`plan(slot, seq)` composes a micro-batch: first the running requests with tokens to compute (oldest first: a
decode costs one token, a prefill chunk up to the token budget), then new requests admitted in arrival order. A
request's prefill chunks may sit in several in-flight micro-batches at once (chunked pipeline prefill): each stage
runs micro-batches in order, so chunk k's KV is written on every stage before chunk k+1 reaches it. Only a step
that needs the previous sampled token waits for it. Stage 0 allocates KV blocks and writes their numbers into the
plan (no other stage runs an allocator). When the pool is short, the newest running request with nothing in flight
is preempted: its KV is freed and it is recomputed later.

`on_output(seq, values)` takes a micro-batch's sampled tokens when they come back around the ring (a drafted
decode's kept ones: `speculation.py`), decides finishes and returns what the front end should see. KV of a finished
or aborted request is freed in the next plan, which every stage applies before that plan's batch: no in-flight
batch still holds it, as a request is freed only when none of its micro-batches is in flight. Prefix caching is
`prefix.py`'s part of planning (`PrefixIndex`).
"""

from __future__ import annotations

import dataclasses
import logging
import random
from collections import OrderedDict, deque

from ringsched.comm.messages import BatchPlan, NewRequest, PlanEntry, TokenOutput
from ringsched.kv.cache import BlockTable
from ringsched.kv.cp_blocks import CPBlocks
from ringsched.sampling.params import SamplingParams
from ringsched.scheduler.chunking import ChunkSizer
from ringsched.scheduler.prefix import PrefixIndex
from ringsched.scheduler.refusals import refusal
from ringsched.scheduler.request import Request, Status
from ringsched.scheduler.returns import split, take
from ringsched.scheduler.speculation import NO_DRAFTS, NoDrafts, Speculator

logger = logging.getLogger(__name__)


class Planner:
    def __init__(
        self,
        blocks: BlockTable | CPBlocks,
        micro_batch_size: int,
        max_running: int,
        token_budget: int,
        eos_ids: tuple[int, ...],
        max_len: int,
        rng: random.Random | None = None,
        vocab_size: int | None = None,
        flexible_cut: bool = False,
        chunker: ChunkSizer | None = None,
        speculator: Speculator | NoDrafts = NO_DRAFTS,
    ) -> None:
        self.blocks = blocks
        self.micro_batch_size, self.max_running, self.token_budget = micro_batch_size, max_running, token_budget
        self.eos_ids, self.max_len, self.vocab_size = eos_ids, max_len, vocab_size
        # A flexible cut: blocks are indexed for the prefix cache when their micro-batch comes back (a shared
        # layer's KV reaches stage 0 only then).
        self.flexible_cut, self.chunker, self.speculator = flexible_cut, chunker, speculator
        self._decoding = 0  # decoding requests as this plan began (sizes chunks beside them)
        self.pipelined_chunks = 0
        self.waiting: deque[Request] = deque()
        self.running: OrderedDict[str, Request] = OrderedDict()  # admission order
        self.requests: dict[str, Request] = {}
        self.flight: dict[int, list[PlanEntry]] = {}
        self._frees: list[tuple[str, bool]] = []  # (rid, forget entirely) for the next plan
        self._arrivals = 0
        self._rng = rng or random.Random(0)
        self._prefix = PrefixIndex(blocks, self.requests)  # the prefix cache's side of planning
        self.num_preemptions = 0
        self.prefill_tokens = 0  # prompt tokens planned for computation so far (recomputation included)

    # -- intake ----------------------------------------------------------------------------------------
    def add(self, new: NewRequest) -> TokenOutput | None:
        """Queue a request; an error output instead when it can never be served (whatever is wrong with it: a
        request the front end did not check must not take the stage down)."""
        try:
            params = SamplingParams.from_dict(new.params)
        except (TypeError, ValueError) as e:
            return TokenOutput(new.rid, [], "error", f"bad sampling parameters: {e}", len(new.token_ids), 0)
        if params.seed is None and not params.greedy:
            # A fallback: the front ends seed every random request (`SamplingParams.seeded`), so that a replay
            # carries the seed it first ran with; one sent without a seed still samples reproducibly from here on.
            params = dataclasses.replace(params, seed=self._rng.randrange(2**31))
        error = refusal(
            new,
            params,
            max_len=self.max_len,
            capacity_tokens=self.blocks.capacity_tokens,
            vocab_size=self.vocab_size,
            in_use=new.rid in self.requests,
            scores_prompts=self.blocks.scores_prompts,
        )
        if error:
            return TokenOutput(new.rid, [], "error", error, len(new.token_ids), len(new.output_ids))
        # A replay starts as a preempted request does: prompt and outputs to compute, then the next token.
        outs = list(new.output_ids)
        r = Request(new.rid, list(new.token_ids), params, self._arrivals, outs, replay=bool(outs))
        ended = r.check_finish(self.eos_ids, self.max_len) if r.output_ids else None
        if ended:  # a replay of a request that had already ended: nothing left to generate
            return TokenOutput(r.rid, [], ended, None, len(r.prompt_ids), len(r.output_ids))
        self._arrivals += 1
        self.requests[r.rid] = r
        self.waiting.append(r)
        return None

    def abort(self, rid: str) -> TokenOutput | None:
        r = self.requests.get(rid)
        if r is None or r.aborted or r.status is Status.FINISHED:
            return None
        r.aborted = True
        if r.status is Status.WAITING:
            self.waiting.remove(r)
            self._finish(r, free_now=True)
        elif not r.in_flight:
            self._finish(r, free_now=True)
        else:  # planned no more; freed when its last micro-batch comes back (on_output)
            self.running.pop(rid, None)
        return TokenOutput(rid, [], "abort", None, len(r.prompt_ids), len(r.output_ids))

    # -- planning --------------------------------------------------------------------------------------
    def plan(self, slot: int, seq: int) -> BatchPlan:
        plan = BatchPlan(slot=slot, seq=seq)
        self._plan_frees(plan)
        self._decoding = self._count_decoding() if self.chunker is not None else 0
        budget = self._plan_running(plan, seq, self.token_budget)
        self._admit_waiting(plan, seq, budget)
        self.speculator.extend(plan, self.requests)
        if plan.entries:
            self.flight[seq] = plan.entries
        if self._prefix.cache is not None and not self.flexible_cut:
            # Indexed once the whole micro-batch is planned: only a later micro-batch may read these blocks.
            for e in plan.entries:
                self._prefix.index(self.requests[e.rid], e.start + len(e.token_ids) - e.drafts)
        return plan

    def _plan_frees(self, plan: BatchPlan) -> None:
        """The KV of requests that ended since the last plan: freed here, and on every stage by the plan."""
        for rid, forget in self._frees:
            self.blocks.free(rid)
            plan.frees.append(rid)
            if forget:
                plan.drops.append(rid)
        self._frees.clear()

    def _plan_running(self, plan: BatchPlan, seq: int, budget: int) -> int:
        """Running requests with tokens to compute, oldest first; returns the token budget left."""
        for r in list(self.running.values()):
            if len(plan.entries) >= self.micro_batch_size:
                break
            if r.status is not Status.RUNNING:
                continue
            n = 1 if r.remaining == 1 else min(self._chunk(r), budget)
            if n <= 0 or not self._grow(r, n, plan):
                continue
            self._schedule(r, n, seq, plan)
            budget -= n
        return budget

    def _admit_waiting(self, plan: BatchPlan, seq: int, budget: int) -> None:
        """New requests in arrival order, from their cached prefix, while the budget, the micro-batch, the running
        limit and the KV pool allow."""
        planned = self._prefix.planned_blocks(plan) if self.waiting else set()
        for r in list(self.waiting):
            if budget <= 0 or len(plan.entries) >= self.micro_batch_size or len(self.running) >= self.max_running:
                break
            cached = self._prefix.cached_prefix(r)
            if self._prefix.computed_beside(r, len(cached), planned):
                continue  # the next micro-batch finds those blocks cached (n > 1, or a burst behind one prefix)
            r.num_computed = len(cached) * self.blocks.block_size
            n = min(self._chunk(r), budget)  # room for its outputs too, if it has some (it computes them next)
            if not self.blocks.can_hold(r.rid, max(r.num_computed + n, r.num_tokens), cached):
                r.num_computed = 0
                break
            self.waiting.remove(r)
            r.status = Status.RUNNING
            self.running[r.rid] = r
            self._prefix.admit(r, cached)
            self._schedule(r, n, seq, plan, cached)
            budget -= n
            planned |= self._prefix.planned_blocks(plan, plan.entries[-1:])

    def _chunk(self, r: Request) -> int:
        """Tokens `r` computes next with no budget limit: what is left of its prompt, or its dynamic chunk of it.
        Outputs computed again (a replay's, a preempted one's) go one a step as decoded: the same KV, bit for bit."""
        prompt_left = min(r.remaining, len(r.prompt_ids) - r.num_computed)
        if r.remaining <= 1 or prompt_left <= 0:
            return min(r.remaining, 1)
        return prompt_left if self.chunker is None else self.chunker.size(r.num_computed, prompt_left, self._decoding)

    def _count_decoding(self) -> int:
        """Running requests past their prefill (decoding here or in flight): the steps a chunk would delay."""
        return sum(1 for r in self.running.values() if r.output_ids and r.num_computed >= r.num_tokens - 1)

    def _schedule(self, r: Request, n: int, seq: int, plan: BatchPlan, cached: list[int] | None = None) -> None:
        start = r.num_computed
        blocks = self.blocks.grow(r.rid, start + n)  # the entry's new blocks (per CP rank with CPBlocks)
        if not r.announced:
            plan.announce.append(NewRequest(r.rid, [], r.params.to_dict(), len(r.prompt_ids)))
            r.announced = True
        self.prefill_tokens += max(min(start + n, len(r.prompt_ids)) - start, 0)
        samples = start + n == r.num_tokens
        if cached:
            blocks.update(cached_blocks=cached, cached_ids=r.ids(0, start))
        scored = r.scored_ids(start, n)
        plan.entries.append(PlanEntry(r.rid, start, r.ids(start, start + n), samples, scored_ids=scored, **blocks))
        r.num_computed = start + n
        if r.in_flight:  # its earlier chunks are still on the ring
            plan.reads.extend(s for s in r.in_flight if s not in plan.reads)
            self.pipelined_chunks += 1
        r.in_flight.add(seq)
        decode = n == 1 and start == r.num_tokens - 1 and bool(r.output_ids)
        if not decode and logger.isEnabledFor(logging.DEBUG):
            r.chunks.append(n)
            if samples:
                logger.debug("request %s: prefill of %d tokens in chunks %s", r.rid, r.num_tokens, r.chunks)
                r.chunks = []

    def _grow(self, r: Request, n: int, plan: BatchPlan) -> bool:
        """Make room for `n` more tokens of `r`, preempting newer idle requests; False if `r` must wait."""
        while not self.blocks.can_hold(r.rid, r.num_computed + n):
            victim = next((v for v in reversed(self.running.values()) if not v.in_flight and v is not r), None)
            if victim is None:
                if len(self.running) > 1 and not r.in_flight:
                    self._preempt(r, plan)  # give way to the older in-flight ones
                return False
            self._preempt(victim, plan)
        return True

    def _preempt(self, r: Request, plan: BatchPlan) -> None:
        self.blocks.free(r.rid)
        plan.frees.append(r.rid)
        del self.running[r.rid]
        r.status, r.num_computed, r.chunks = Status.WAITING, 0, []
        r.num_preemptions += 1
        self.num_preemptions += 1
        # Back to the front: it was admitted before everything still waiting.
        self.waiting.appendleft(r)

    # -- results ---------------------------------------------------------------------------------------
    def on_output(self, seq: int, values: list[int]) -> list[TokenOutput]:
        """`values`: what the last stage sampled for micro-batch `seq` (`returns.split`)."""
        entries = self.flight.pop(seq, [])
        sampled, scores = split(seq, entries, values, lambda rid: self.requests[rid].params)
        outs: list[TokenOutput] = []
        for i, e in enumerate(entries):
            r = self.requests[e.rid]
            r.in_flight.discard(seq)
            if self._prefix.cache is not None and self.flexible_cut:  # its KV is on both stages now
                self._prefix.index(r, e.start + len(e.token_ids) - e.drafts)
            if r.aborted:
                if not r.in_flight:  # its last micro-batch passed every stage
                    self._finish(r, free_now=True)
                continue
            r.keep_scores(e.start, scores.get(i, []))
            if e.samples:
                tokens, logprobs = sampled[i]
                if tokens[0] >= 0:
                    self.speculator.kept(r.rid, e.drafts, len(tokens))
                outs.append(take(r, e, tokens, logprobs, self.eos_ids, self.max_len))
                if e.drafts:
                    self.blocks.rewind(r.rid, r.num_computed)  # rejected drafts' positions
                if outs[-1].finish_reason:
                    self._finish(r, free_now=True)
        return outs

    def _finish(self, r: Request, free_now: bool) -> None:
        r.status = Status.FINISHED
        self.running.pop(r.rid, None)
        self.requests.pop(r.rid, None)
        self.speculator.forget(r.rid)
        if free_now:
            self._frees.append((r.rid, r.announced))

    def step_took(self, rows: int, seconds: float) -> None:
        """Stage 0 computed a micro-batch of `rows` rows in `seconds` (what drafting weighs a draft's row by)."""
        self.speculator.step_took(rows, seconds)

    # -- state -----------------------------------------------------------------------------------------
    @property
    def in_flight(self) -> int:
        return len(self.flight)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.flight or self._frees)

    def stats(self) -> dict:
        return {
            "running": len(self.running),
            "waiting": len(self.waiting),
            "kv_usage": self.blocks.usage,
            "preemptions": self.num_preemptions,
            **self._prefix.stats(),
            "prefill_tokens": self.prefill_tokens,
            # the most in-flight micro-batches one request is in now (> 1: its prefill chunks fill the ring)
            "request_in_flight_max": max((len(r.in_flight) for r in self.requests.values()), default=0),
            "pipelined_chunks": self.pipelined_chunks,  # chunks planned while the request's one before was in flight
            **self.speculator.stats(),
        }
