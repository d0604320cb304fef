"""What the last stage sends back for a micro-batch, split per entry (`Planner.on_output`).

The values are, per sampling entry in plan order, its `1 + drafts` sampled values (a verified entry's kept tokens
padded with `verify.FILLER`; a failed row's first value is negative), then the log-probabilities asked for, one
set per sampled position (`sampler.logprob_values`), then the scores of the prompt positions entries score, one per
scored id (`prompt_logprobs.score_values`).
"""

from __future__ import annotations

from collections.abc import Callable

from ringsched.comm.messages import PlanEntry, TokenOutput
from ringsched.sampling.params import SamplingParams
from ringsched.sampling.prompt_logprobs import Scored, score_width, unpack_scores
from ringsched.sampling.sampler import Logprobs, logprob_width, unpack_logprobs
from ringsched.scheduler.request import Request
from ringsched.speculative.verify import unpadded

Sampled = dict[int, tuple[list[int], list[Logprobs | None]]]


def split(
    seq: int, entries: list[PlanEntry], values: list[int], params_of: Callable[[str], SamplingParams]
) -> tuple[Sampled, dict[int, list[Scored]]]:
    """Per sampling entry (by its index in `entries`): its tokens (the kept ones, or one negative for a failed row)
    and each one's log-probabilities (None where not asked for); per scoring entry, its prompt positions' scores."""
    sampled = [(i, e) for i, e in enumerate(entries) if e.samples]
    rows = sum(1 + e.drafts for _, e in sampled)
    ks = [params_of(e.rid).logprobs for _, e in sampled for _ in range(1 + e.drafts)]
    scoring = [(i, e, params_of(e.rid).prompt_logprobs or 0) for i, e in enumerate(entries) if e.scored_ids]
    score_ks = [k for _, e, k in scoring for _ in e.scored_ids]
    width = logprob_width(ks)
    if rows + width + score_width(score_ks) != len(values):
        raise RuntimeError(
            f"micro-batch {seq}: expected {rows} sampled tokens, {width} log-probability values and "
            f"{score_width(score_ks)} prompt score values, got {len(values)} values"
        )
    logprobs = unpack_logprobs(values[rows : rows + width], ks)
    out, at = {}, 0
    for i, e in sampled:
        n = 1 + e.drafts
        tokens = unpadded(values[at : at + n])
        out[i] = (tokens, logprobs[at : at + len(tokens)])
        at += n
    scores, flat, at = {}, unpack_scores(values[rows + width :], score_ks), 0
    for i, e, _ in scoring:
        scores[i] = flat[at : at + len(e.scored_ids)]
        at += len(e.scored_ids)
    return out, scores


def take(
    r: Request, e: PlanEntry, tokens: list[int], logprobs: list[Logprobs | None], eos_ids: tuple[int, ...], max_len: int
) -> TokenOutput:
    """`r`'s new `tokens` from entry `e`, up to the first that ends it (the caller finishes it when the output has a
    finish reason). A drafted entry's KV stays valid up to its last kept draft."""
    if tokens[0] < 0:  # the last stage could not sample it (sampler_state.FAILED): this request alone ends
        error = "the request failed on the last stage while sampling its next token (see that stage's log)"
        return TokenOutput(r.rid, [], "error", error, len(r.prompt_ids), len(r.output_ids), "request_failed")
    prompt_logprobs = r.take_scores()
    reason, n = None, 0
    while reason is None and n < len(tokens):
        r.output_ids.append(tokens[n])
        n += 1
        reason = r.check_finish(eos_ids, max_len)
    r.num_computed = e.start + len(e.token_ids) - e.drafts + n - 1
    lps = None if logprobs[0] is None else logprobs[:n]
    return TokenOutput(
        r.rid,
        tokens[:n],
        reason,
        None,
        len(r.prompt_ids),
        len(r.output_ids),
        cached_tokens=r.cached_tokens,
        logprobs=lps,
        prompt_logprobs=prompt_logprobs,
    )
