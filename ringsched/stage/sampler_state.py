"""What the last stage remembers per request to sample: parameters (with the seed), the token history.

The history is indexed by position and rewritten from each plan entry, so a request recomputed after preemption
does not duplicate tokens (an entry's speculative drafts stay in it until the next entry starts at the first unkept
one). A random row draws with the key (seed, tokens the request has produced), both known from the announcement and
the history, so seeded output does not depend on preemption, batch composition or the number of stages, and a fresh
`SamplerState` given the same announcement and entries (a replacement process) samples the same next token as the
one that sampled all along: there is no generator state. An entry with drafts samples each of its `1 + drafts`
rows as if the drafts before the row had been produced and keeps the tokens up to the first row whose token is not
its draft (`speculative/verify.py`); a structured request's drafts are cut at the first its grammar refuses."""

from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import NamedTuple

import torch

from ringsched.comm.messages import BatchPlan
from ringsched.sampling.params import SamplingParams
from ringsched.sampling.sampler import DrawKey, logprob_values, sample
from ringsched.sampling.structured import Constraint, GrammarError, Grammars
from ringsched.speculative.verify import accept, expand, padded

logger = logging.getLogger("ringsched.layout.rank")

FAILED = -1  # the token of a row whose request could not be sampled: stage 0 ends that request with an error


class Sampled(NamedTuple):
    """A sampling entry as this stage samples it: its request, its drafts (cut where its grammar refuses one), its
    logits rows (`1 +` the drafts it was planned with)."""

    rid: str
    drafts: list[int]
    rows: int


class SamplerState:
    def __init__(self, device: torch.device, eos_ids: tuple[int, ...] = (), grammars: Grammars | None = None) -> None:
        self.device, self.eos_ids, self.grammars = device, eos_ids, grammars
        # structured requests: their grammar state, built on the grammar thread (a failed build fails its
        # request when it samples)
        self.constraints: dict[str, Future[Constraint]] = {}
        # structured requests not yet sampled here: a replay's grammar first consumes the outputs it arrived with
        self._unsampled: set[str] = set()
        self.prompt_len: dict[str, int] = {}
        self.params: dict[str, SamplingParams] = {}
        self.history: dict[str, list[int]] = {}

    def apply(self, plan: BatchPlan) -> None:
        for rid in plan.drops:
            self.params.pop(rid, None)
            self.history.pop(rid, None)
            self.prompt_len.pop(rid, None)
            self.constraints.pop(rid, None)
            self._unsampled.discard(rid)
        for new in plan.announce:
            p = SamplingParams.from_dict(new.params)
            self.params[new.rid] = p
            self.history[new.rid] = []
            self.prompt_len[new.rid] = new.prompt_len
            if p.grammar is not None:
                self.constraints[new.rid] = self._build(p.grammar, p.grammar_after)
                self._unsampled.add(new.rid)
        for e in plan.entries:
            h = self.history[e.rid]
            if e.cached_ids:  # a prefix this entry does not compute
                h[:] = e.cached_ids
            del h[e.start :]
            h.extend(e.token_ids)

    def _build(self, grammar: str, after: tuple[int, ...]) -> Future[Constraint]:
        if self.grammars is not None:
            return self.grammars.build(grammar, after)
        return _failed("this stage was started without structured-output support")

    def greedy_only(self, plan: BatchPlan) -> bool:
        """Every row that samples takes the plain argmax (no penalty, nothing banned): the last stage can then
        reduce the logits chunk by chunk (`StageModel.greedy_tokens`) instead of building them whole."""
        params = [self.params[e.rid] for e in plan.entries if e.samples]
        return all(p.plain for p in params)

    def sample(self, plan: BatchPlan, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The token each logits row draws, and per sampling entry its `1 + drafts` values for stage 0 (`keep`);
        `FAILED` first for an entry whose request's parameters made sampling raise. The batch is sampled whole;
        only when that fails is it retried entry by entry to find the culprits, so one request's failure never
        costs the others their tokens."""
        entries = self._entries(plan)
        try:
            targets = self._sample(entries, logits)
            return targets, self._keep(entries, targets)
        except Exception:
            logger.exception(
                "sampling micro-batch %d failed; sampling its %d entries one by one", plan.seq, len(entries)
            )
        targets, kept, at = torch.full((logits.shape[0],), FAILED, dtype=torch.long), [], 0
        for e in entries:
            try:
                targets[at : at + e.rows] = self._sample([e], logits[at : at + e.rows]).to(targets.device)
                kept.append(self._keep([e], targets[at : at + e.rows]))
            except Exception as err:
                logger.error(
                    "request %s: sampling failed, it ends with an error: %s: %s", e.rid, type(err).__name__, err
                )
                kept.append(torch.tensor(padded([FAILED], e.rows)))
            at += e.rows
        return targets, torch.cat(kept)

    def keep(self, plan: BatchPlan, targets: torch.Tensor) -> torch.Tensor:
        """Greedy rows' argmax `targets` as `sample` returns its second part: the targets themselves where no entry
        has drafts to verify and no request a grammar to advance (a plain step: no work per row)."""
        if not self.constraints and not any(e.drafts for e in plan.entries):
            return targets.to(torch.long)
        return self._keep(self._entries(plan), targets)

    def _entries(self, plan: BatchPlan) -> list[Sampled]:
        return [
            self._grammar_cut(Sampled(e.rid, e.token_ids[len(e.token_ids) - e.drafts :], 1 + e.drafts))
            for e in plan.entries
            if e.samples
        ]

    def _grammar_cut(self, e: Sampled) -> Sampled:
        """`e` with its drafts cut before the first its request's grammar refuses (as they are where it has none,
        or where its grammar cannot be used: the request then fails when sampled)."""
        built = self.constraints.get(e.rid) if e.drafts else None
        if built is None:
            return e
        try:
            constraint = self._caught_up(e.rid, built.result(), self._before(e))
        except Exception:
            return e
        return e._replace(drafts=e.drafts[: constraint.admits(e.drafts)])

    def _keep(self, entries: list[Sampled], targets: torch.Tensor) -> torch.Tensor:
        """Per entry the tokens it keeps (`verify.accept`), padded to its rows; each structured request's grammar
        moves on by them (a request whose grammar refuses one fails alone: `FAILED`)."""
        values, at, rows = targets.tolist(), 0, []
        for e in entries:
            kept = accept(values[at : at + e.rows], e.drafts) if e.drafts else values[at : at + 1]
            rows.append(padded(self._advance(e.rid, kept), e.rows))
            at += e.rows
        return torch.tensor([v for r in rows for v in r], dtype=torch.long)

    def _allowed(self, entries: list[Sampled]) -> list[torch.Tensor | None] | None:
        """Per logits row the grammar's mask (None for a request without one): a drafted entry's row `j` as after
        its first `j` drafts."""
        if not self.constraints:
            return None
        out: list[torch.Tensor | None] = []
        for e in entries:
            built = self.constraints.get(e.rid)
            if built is None:
                out += [None] * e.rows
                continue
            try:
                constraint = self._caught_up(e.rid, built.result(), self._before(e))
                masks = constraint.masks_along(e.drafts)[1] if e.drafts else [constraint.allowed()]
            except GrammarError as err:  # a bad grammar fails its own request, never the stage
                raise GrammarError(f"its grammar could not be used: {err}") from None
            out += masks + [masks[-1]] * (e.rows - len(masks))  # rows past the kept drafts are not read
        return out

    def _caught_up(self, rid: str, constraint: Constraint, before: list[int]) -> Constraint:
        """`constraint`, moved on by the outputs its request held when it first sampled here: none for a request
        sampled here all along, the delivered tokens for a replay (a ring before this one sampled them)."""
        if rid in self._unsampled:
            self._unsampled.discard(rid)
            try:
                for tok in before[self.prompt_len[rid] :]:
                    constraint.advance(tok)
            except Exception as e:  # the request fails, and stays failed when its row is sampled again alone
                self.constraints[rid] = _failed(f"it refused a token delivered before the replay: {e}")
                raise GrammarError(f"it refused a token delivered before the replay: {e}") from None
        return constraint

    def _advance(self, rid: str, kept: list[int]) -> list[int]:
        """Move a structured request's grammar on by its kept tokens (once final); `[FAILED]` if it refuses one."""
        built = self.constraints.get(rid)
        if built is not None:
            try:
                for tok in kept:
                    built.result().advance(tok)
            except Exception as e:
                logger.error("request %s: its grammar refused token %d, it ends with an error: %s", rid, tok, e)
                return [FAILED]
        return kept

    def logprobs(self, plan: BatchPlan, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The log-probabilities the sampling rows ask for, packed (`sampler.logprob_values`); empty if none."""
        ks = [self.params[e.rid].logprobs for e in plan.entries if e.samples for _ in range(1 + e.drafts)]
        return logprob_values(logits, targets, ks)

    def _sample(self, entries: list[Sampled], logits: torch.Tensor) -> torch.Tensor:
        params = [self.params[e.rid] for e in entries]
        needs_history = any(p.needs_history for p in params)
        histories = [self._before(e) if needs_history else [] for e in entries]
        keys = [self._key(e, p) for e, p in zip(entries, params, strict=True)]
        rows_params, rows_hist, rows_keys = expand(
            [e.drafts + [0] * (e.rows - 1 - len(e.drafts)) for e in entries], params, histories, keys
        )
        lens = [self.prompt_len[e.rid] if needs_history else 0 for e in entries for _ in range(e.rows)]
        return sample(
            logits, rows_params, rows_hist, rows_keys, self._banned(entries, params), lens, self._allowed(entries)
        )

    def _before(self, e: Sampled) -> list[int]:
        """The request's tokens before the entry's drafts (the history itself where it has none: no copy)."""
        h = self.history[e.rid]
        return h[: len(h) - (e.rows - 1)] if e.rows > 1 else h

    def _produced(self, e: Sampled) -> int:
        """Tokens the request has produced before the entry's drafts: the index, in its output, of the token its
        first row samples."""
        return len(self.history[e.rid]) - (e.rows - 1) - self.prompt_len[e.rid]

    def _key(self, e: Sampled, p: SamplingParams) -> DrawKey | None:
        # Every random request arrives seeded (the front end's `SamplingParams.seeded`, else `Planner.add`'s fallback),
        # so even unseeded sampling replays identically.
        return None if p.greedy else (p.seed or 0, self._produced(e))

    def _banned(self, entries: list[Sampled], params: list[SamplingParams]) -> list[list[int]] | None:
        """Under `min_tokens`, a request may not draw its stop ids (nor EOS unless it ignores EOS): per row, as the
        row's token would be its output's."""
        if all(p.min_tokens == 0 for p in params):
            return None
        out = []
        for e, p in zip(entries, params, strict=True):
            stop = list(p.stop_token_ids) + ([] if p.ignore_eos else list(self.eos_ids))
            produced = self._produced(e)
            out += [stop if produced + j < p.min_tokens else [] for j in range(e.rows)]
        return out


def _failed(error: str) -> Future[Constraint]:
    """A constraint that cannot be used: its request fails when it samples."""
    failed: Future[Constraint] = Future()
    failed.set_exception(GrammarError(error))
    return failed
