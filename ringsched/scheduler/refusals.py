"""Why stage 0 refuses a request outright: one it can never serve ends with an error output instead of taking the
stage down, whatever is wrong with it (the front end checks the same, but stage 0 does not rely on that)."""

from __future__ import annotations

from ringsched.comm.messages import NewRequest
from ringsched.sampling.params import SamplingParams

PROMPT_LOGPROBS_WITH_CP = (
    "prompt_logprobs is not computed with --cp-size > 1 (a prompt chunk's positions are split over the "
    "context-parallel ranks); drop prompt_logprobs, or serve with --cp-size 1"
)


def refusal(
    new: NewRequest,
    params: SamplingParams,
    *,
    max_len: int,
    capacity_tokens: int,
    vocab_size: int | None,
    in_use: bool,
    scores_prompts: bool = True,
) -> str | None:
    """The error message for a request that can never be served, or None. `in_use`: its id is taken. A replay
    (`new.output_ids`) is checked as its first submission was, on its prompt: `max_tokens` counts its outputs.
    `scores_prompts`: False where prompt log-probabilities cannot be computed (`--cp-size` > 1)."""
    ids, vocab = new.token_ids, vocab_size
    need = len(ids) + params.max_tokens
    if not ids:
        return "the prompt is empty"
    if len(ids) >= max_len:
        return f"the prompt has {len(ids)} tokens; the maximum context length is {max_len}"
    if min(need, max_len) > capacity_tokens:
        return (
            f"the request needs {need} tokens of KV but the pool holds {capacity_tokens}; raise "
            "--kv-cache-memory, or spread a request's KV over more ranks with --cp-size"
        )
    if params.prompt_logprobs is not None and not scores_prompts:
        return PROMPT_LOGPROBS_WITH_CP
    if in_use:
        return f"request id {new.rid!r} is already in use"
    if vocab is not None:
        bad = [i for i in ids if not (isinstance(i, int) and 0 <= i < vocab)]
        if bad:
            return f"the prompt has token ids outside the vocabulary [0, {vocab}): {bad[:5]}"
        bad = [i for i in new.output_ids if not (isinstance(i, int) and 0 <= i < vocab)]
        if bad:
            return f"the replayed output has token ids outside the vocabulary [0, {vocab}): {bad[:5]}"
        bad = [i for i in params.stop_token_ids if i >= vocab]
        if bad:
            return f"stop_token_ids has ids outside the vocabulary [0, {vocab}): {bad[:5]}"
        bad = [i for i, _ in params.logit_bias if i >= vocab]
        if bad:
            return f"logit_bias has ids outside the vocabulary [0, {vocab}): {bad[:5]}"
    return None
