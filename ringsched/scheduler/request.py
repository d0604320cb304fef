"""A request as stage 0's scheduler tracks it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from ringsched.sampling.params import SamplingParams
from ringsched.sampling.prompt_logprobs import Scored, prompt_targets


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: int  # admission order
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose KV is in the cache (planned, possibly still in flight)
    # seqs of the in-flight micro-batches holding it: several prefill chunks at once, or one decode
    in_flight: set[int] = field(default_factory=set)
    status: Status = Status.WAITING
    announced: bool = False  # the other stages know its parameters
    finish_reason: str | None = None
    aborted: bool = False
    num_preemptions: int = 0
    chunks: list[int] = field(default_factory=list)  # this prefill's chunk lengths so far (debug log)
    block_hashes: list[bytes] = field(default_factory=list)  # prefix caching: its full blocks' chained hashes
    cached_tokens: int = 0  # prompt tokens its first admission found in the prefix cache
    # admitted with outputs an earlier ring delivered (`NewRequest.output_ids`): the front end already holds
    # its first admission's `cached_tokens`
    replay: bool = False
    prompt_scores: dict[int, Scored] = field(default_factory=dict)  # by the position of the prompt token scored

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def ids(self, start: int, end: int) -> list[int]:
        """`all_ids[start:end]`, without building `all_ids` (a decode step's one token costs O(1), not O(length))."""
        p = len(self.prompt_ids)
        if start >= p:
            return self.output_ids[start - p : end - p]
        if end <= p:
            return self.prompt_ids[start:end]
        return self.prompt_ids[start:] + self.output_ids[: end - p]

    def scored_ids(self, start: int, n: int) -> list[int]:
        """The prompt tokens an entry of positions `[start, start + n)` scores: with `prompt_logprobs`, until the first
        output token (a replay's or a preempted request's recomputed prompt is not scored again)."""
        if self.params.prompt_logprobs is None or self.output_ids:
            return []
        return prompt_targets(self.prompt_ids, start, n)

    def keep_scores(self, start: int, scores: list[Scored]) -> None:
        """The scores of an entry that starts at `start`: those of the prompt tokens after it, in order."""
        self.prompt_scores.update(zip(range(start + 1, start + 1 + len(scores)), scores, strict=True))

    def take_scores(self) -> list | None:
        """With the first output token: the prompt's scores in order (`TokenOutput.prompt_logprobs`), once."""
        if self.params.prompt_logprobs is None or self.output_ids:
            return None
        scores = [list(self.prompt_scores[p]) for p in range(1, len(self.prompt_ids))]
        self.prompt_scores = {}
        return scores

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def remaining(self) -> int:
        """Tokens still to compute before the next sample."""
        return self.num_tokens - self.num_computed

    def check_finish(self, eos_ids: tuple[int, ...], max_len: int) -> str | None:
        """Finish reason after the newest output token, or None to go on."""
        p, out = self.params, self.output_ids
        last = out[-1]
        if len(out) >= p.min_tokens:
            if last in p.stop_token_ids or (not p.ignore_eos and last in eos_ids):
                return "stop"
        if len(out) >= p.max_tokens or self.num_tokens >= max_len:
            return "length"
        return None
