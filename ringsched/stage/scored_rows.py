"""Which of the last stage's logits rows are prompt positions to score and which sample.

A plan entry with `scored_ids` computes logits for its first `len(scored_ids)` positions too (the batch puts them
before its sampled rows, `attention/batch.py`), so a micro-batch's logits rows are, per entry in plan order, its
scored rows and then its `1 + drafts` sampled ones. `ScoredRows` splits them, so the sampler sees only its rows.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ringsched.comm.messages import BatchPlan
from ringsched.sampling.params import SamplingParams
from ringsched.sampling.prompt_logprobs import score_values


class ScoredRows(NamedTuple):
    scored: torch.Tensor  # logits rows of scored prompt positions
    sampled: torch.Tensor  # logits rows that sample
    targets: torch.Tensor  # the prompt token each scored row gives the log-probability of
    ks: list[int]  # per scored row, how many most likely tokens its request asked for

    @classmethod
    def of(cls, plan: BatchPlan, params: dict[str, SamplingParams]) -> ScoredRows | None:
        """The split of `plan`'s logits rows, or None when no entry scores its prompt."""
        if not any(e.scored_ids for e in plan.entries):
            return None
        scored, sampled, targets, ks, at = [], [], [], [], 0
        for e in plan.entries:
            n = len(e.scored_ids)
            scored += range(at, at + n)
            targets += e.scored_ids
            ks += [params[e.rid].prompt_logprobs or 0] * n
            at += n
            if e.samples:
                sampled += range(at, at + 1 + e.drafts)
                at += 1 + e.drafts
        return cls(torch.tensor(scored), torch.tensor(sampled, dtype=torch.long), torch.tensor(targets), ks)

    def split(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows that sample, and the packed scores of the others (`prompt_logprobs.score_values`)."""
        device = logits.device
        values = score_values(logits[self.scored.to(device)], self.targets, self.ks)
        return logits[self.sampled.to(device)], values
