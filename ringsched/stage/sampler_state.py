"""What the last stage remembers per request to sample: parameters (with the seed), the token history.

The history is indexed by position and rewritten from each plan entry, so a request recomputed after
preemption does not duplicate tokens. A random row draws with the key (seed, tokens the request has produced),
both known from the announcement and the history, so seeded output does not depend on preemption, batch
composition or the number of stages, and a fresh `SamplerState` given the same announcement and entries (a
replacement process) samples the same next token as the one that sampled all along: there is no generator state.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future

import torch

from ringsched.comm.messages import BatchPlan
from ringsched.sampler import DrawKey, logprob_values, sample
from ringsched.sampling import SamplingParams
from ringsched.structured import Constraint, GrammarError, Grammars

logger = logging.getLogger("ringsched.layout.rank")

FAILED = -1  # the token of a row whose request could not be sampled: stage 0 ends that request with an error


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
                self.constraints[new.rid] = self._build(p.grammar)
                self._unsampled.add(new.rid)
        for e in plan.entries:
            h = self.history[e.rid]
            if e.cached_ids:  # a prefix this entry does not compute
                h[:] = e.cached_ids
            del h[e.start :]
            h.extend(e.token_ids)

    def _build(self, grammar: str) -> Future[Constraint]:
        if self.grammars is not None:
            return self.grammars.build(grammar)
        return _failed("this stage was started without structured-output support")

    def greedy_only(self, plan: BatchPlan) -> bool:
        """Every row that samples takes the plain argmax (no penalty, nothing banned): the last stage can then
        reduce the logits chunk by chunk (`StageModel.greedy_tokens`) instead of building them whole."""
        params = [self.params[e.rid] for e in plan.entries if e.samples]
        return all(p.plain for p in params)

    def sample(self, plan: BatchPlan, logits: torch.Tensor) -> torch.Tensor:
        """One token per sampling row of `plan`; `FAILED` for a row whose request's parameters made sampling
        raise. The batch is sampled whole; only when that fails is it retried row by row to find the culprits,
        so one request's failure never costs the others their tokens."""
        rids = [e.rid for e in plan.entries if e.samples]
        try:
            return self._advance(rids, self._sample(rids, logits))
        except Exception:
            logger.exception("sampling micro-batch %d failed; sampling its %d rows one by one", plan.seq, len(rids))
        tokens = torch.full((len(rids),), FAILED, dtype=torch.long)
        for i, rid in enumerate(rids):
            try:
                tokens[i] = self._advance([rid], self._sample([rid], logits[i : i + 1]))[0].to(tokens.device)
            except Exception as e:
                logger.error("request %s: sampling failed, it ends with an error: %s: %s", rid, type(e).__name__, e)
        return tokens

    def _allowed(self, rids: list[str]) -> list[torch.Tensor | None] | None:
        if not self.constraints:
            return None
        out = []
        for rid in rids:
            built = self.constraints.get(rid)
            if built is None:
                out.append(None)
                continue
            try:
                out.append(self._caught_up(rid, built.result()).allowed())
            except GrammarError as e:  # a bad grammar fails its own request, never the stage
                raise GrammarError(f"its grammar could not be used: {e}") from None
        return out

    def _caught_up(self, rid: str, constraint: Constraint) -> Constraint:
        """`constraint`, moved on by the outputs its request held when it first sampled here: none for a request
        sampled here all along, the delivered tokens for a replay (a ring before this one sampled them)."""
        if rid in self._unsampled:
            self._unsampled.discard(rid)
            try:
                for tok in self.history[rid][self.prompt_len[rid] :]:
                    constraint.advance(tok)
            except Exception as e:  # the request fails, and stays failed when its row is sampled again alone
                self.constraints[rid] = _failed(f"it refused a token delivered before the replay: {e}")
                raise GrammarError(f"it refused a token delivered before the replay: {e}") from None
        return constraint

    def _advance(self, rids: list[str], tokens: torch.Tensor) -> torch.Tensor:
        """Move each structured request's grammar on by its token (once the batch's tokens are final); a request
        whose grammar refuses it fails alone (`FAILED`)."""
        if self.constraints:
            for i, (rid, tok) in enumerate(zip(rids, tokens.tolist(), strict=True)):
                built = self.constraints.get(rid)
                if built is None:
                    continue
                try:
                    built.result().advance(tok)
                except Exception as e:
                    logger.error("request %s: its grammar refused token %d, it ends with an error: %s", rid, tok, e)
                    tokens[i] = FAILED
        return tokens

    def logprobs(self, plan: BatchPlan, logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The log-probabilities the sampling rows ask for, packed (`sampler.logprob_values`); empty if none."""
        ks = [self.params[e.rid].logprobs for e in plan.entries if e.samples]
        return logprob_values(logits, tokens, ks)

    def _sample(self, rids: list[str], logits: torch.Tensor) -> torch.Tensor:
        params = [self.params[r] for r in rids]
        needs_history = any(p.needs_history for p in params)
        histories = [self.history[r] if needs_history else [] for r in rids]
        prompt_lens = [self.prompt_len[r] if needs_history else 0 for r in rids]
        keys = [self._key(r, p) for r, p in zip(rids, params, strict=True)]
        return sample(logits, params, histories, keys, self._banned(rids, params), prompt_lens, self._allowed(rids))

    def _generated(self, rid: str) -> int:
        """Tokens the request has produced so far: the index, in its output, of the token it samples now."""
        return len(self.history[rid]) - self.prompt_len[rid]

    def _key(self, rid: str, p: SamplingParams) -> DrawKey | None:
        # Every random request arrives seeded (the front end's `SamplingParams.seeded`, else `Planner.add`'s fallback),
        # so even unseeded sampling replays identically.
        return None if p.greedy else (p.seed or 0, self._generated(rid))

    def _banned(self, rids: list[str], params: list[SamplingParams]) -> list[list[int]] | None:
        """Under `min_tokens`, a request may not draw its stop ids (nor EOS unless it ignores EOS)."""
        if all(p.min_tokens == 0 for p in params):
            return None
        out = []
        for rid, p in zip(rids, params, strict=True):
            stop = list(p.stop_token_ids) + ([] if p.ignore_eos else list(self.eos_ids))
            out.append(stop if self._generated(rid) < p.min_tokens else [])
        return out


def _failed(error: str) -> Future[Constraint]:
    """A constraint that cannot be used: its request fails when it samples."""
    failed: Future[Constraint] = Future()
    failed.set_exception(GrammarError(error))
    return failed
