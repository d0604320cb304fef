"""Stage 0's side of speculative decoding (`--speculative-config`): drafts for the plan's decodes, learned from
what the last stage keeps.

After a micro-batch is composed, each decode entry (one token, sampling) may take up to `num_speculative_tokens`
drafts from its request's drafter (`speculative/ngram.py`, or `speculative/suffix.py`, whose tree of finished
requests' outputs is shared). How many is `speculative/adaptive.py`'s choice: each request's acceptance so far
against the measured cost of a step of that many more rows (stage 0's compute time per step, by rows). A drafted
entry computes `1 + k` positions, so its request's blocks grow to hold them; positions past the first rejected
draft hold KV nothing reads, which the request's next entry (starting at its first unkept position) overwrites:
no stage needs telling (with `--cp-size`, every rank drops them from its placement when that entry arrives, and
stage 0's allocator when the kept tokens come back: `CPBlocks.rewind`). Drafts are never indexed in the prefix
cache (the planner indexes the entry's tokens before its drafts).
"""

from __future__ import annotations

from ringsched.comm.messages import BatchPlan, PlanEntry
from ringsched.kv.cache import BlockTable
from ringsched.scheduler.request import Request
from ringsched.speculative.adaptive import Acceptance, StepCosts, choose
from ringsched.speculative.config import SpeculativeConfig
from ringsched.speculative.ngram import NgramIndex
from ringsched.speculative.suffix import SuffixDrafter


class NoDrafts:
    """The speculator of a planner without `--speculative-config`: it drafts nothing and learns nothing."""

    def extend(self, plan: BatchPlan, requests: dict[str, Request]) -> None:
        pass

    def kept(self, rid: str, drafts: int, kept: int) -> None:
        pass

    def step_took(self, rows: int, seconds: float) -> None:
        pass

    def forget(self, rid: str) -> None:
        pass

    def stats(self) -> dict:
        return {}


NO_DRAFTS = NoDrafts()


class Speculator:
    """Stage 0's drafts, with `--speculative-config` (the module's docstring)."""

    def __init__(self, config: SpeculativeConfig, blocks: BlockTable, max_len: int) -> None:
        self.config, self.blocks, self.max_len = config, blocks, max_len
        self.costs = StepCosts()
        self.acceptance: dict[str, Acceptance] = {}
        self._ngrams: dict[str, NgramIndex] = {}
        self._suffix = None
        if config.method == "suffix":
            self._suffix = SuffixDrafter(
                config.suffix_decoding_max_tree_depth,
                config.suffix_decoding_max_cached_requests,
                config.suffix_decoding_max_spec_factor,
                config.suffix_decoding_min_token_prob,
            )
        self._given: dict[str, int] = {}  # tokens of each request its suffix drafter holds
        self.draft_tokens = self.accepted_tokens = self.verify_steps = 0

    def extend(self, plan: BatchPlan, requests: dict[str, Request]) -> None:
        """Give the decode entries of `plan` the drafts that raise its expected tokens per second."""
        decodes = [(e, requests[e.rid]) for e in plan.entries if e.samples and len(e.token_ids) == 1]
        if not decodes:
            return
        proposals = [self._propose(r, self._limit(r)) for _, r in decodes]
        rates = [self.acceptance.setdefault(r.rid, Acceptance()).rate for _, r in decodes]
        ks = [len(p) for p in proposals]
        if self.config.adaptive:
            ks = choose(rates, ks, self.costs, plan.num_tokens - len(decodes))
        for (e, _), draft, k in zip(decodes, proposals, ks, strict=True):
            while k and not self.blocks.can_extend(e, e.start + 1 + k):
                k -= 1
            if k:
                self._add(e, draft[:k])

    def _add(self, e: PlanEntry, draft: list[int]) -> None:
        self.blocks.extend(e, e.start + 1 + len(draft))
        e.token_ids = e.token_ids + draft
        e.drafts = len(draft)

    def _limit(self, r: Request) -> int:
        """Drafts `r` may take: kept with its bonus token, they stay within its `max_tokens` and the context."""
        left = min(r.params.max_tokens - len(r.output_ids), self.max_len - r.num_tokens) - 1
        return max(min(self.config.num_speculative_tokens, left), 0)

    def _propose(self, r: Request, k: int) -> list[int]:
        if k <= 0:
            return []
        if self._suffix is None:
            index = self._ngrams.get(r.rid)
            if index is None:
                index = self._ngrams[r.rid] = NgramIndex(
                    [], self.config.prompt_lookup_min, self.config.prompt_lookup_max
                )
            index.extend(r.ids(len(index.tokens), r.num_tokens))
            return index.propose(k)
        given = self._given.get(r.rid)
        if given is None:
            self._suffix.start(r.rid, r.prompt_ids)
            given = len(r.prompt_ids)
        self._suffix.extend(r.rid, r.output_ids[given - len(r.prompt_ids) :])
        self._given[r.rid] = r.num_tokens
        return self._suffix.propose(r.rid, k)

    def kept(self, rid: str, drafts: int, kept: int) -> None:
        """A verified entry came back: `kept` of its `drafts + 1` sampled tokens were kept."""
        if drafts:
            accepted = max(kept - 1, 0)
            self.acceptance.setdefault(rid, Acceptance()).record(drafts, accepted)
            self.draft_tokens += drafts
            self.accepted_tokens += accepted
            self.verify_steps += 1

    def step_took(self, rows: int, seconds: float) -> None:
        self.costs.record(rows, seconds)

    def forget(self, rid: str) -> None:
        """The request ended: its drafter state goes (a suffix drafter keeps its output in the shared tree)."""
        self.acceptance.pop(rid, None)
        self._ngrams.pop(rid, None)
        if self._suffix is not None and self._given.pop(rid, None) is not None:
            self._suffix.finish(rid)

    def stats(self) -> dict:
        return {
            "spec_draft_tokens": self.draft_tokens,
            "spec_accepted_tokens": self.accepted_tokens,
            "spec_verify_steps": self.verify_steps,
        }
