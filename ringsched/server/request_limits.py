"""The limits a request must keep, each refused with OpenAI's message: prompt plus completion within the context
and the KV pool, its sequences' work within `--max-request-tokens`, its token ids within the vocabulary, and a text
too long for the context refused before it is tokenized."""

from __future__ import annotations

from dataclasses import dataclass

from ringsched.sampling.params import SamplingParams
from ringsched.server.errors import APIError
from ringsched.tokenizer import Tokenizer


@dataclass(frozen=True)
class Limits:
    """What requests are checked against: context length, KV tokens of the smallest stage's pool, the model's
    vocabulary (an id beyond it would crash stage 0's embedding), and the one model name served."""

    max_len: int
    kv_tokens: int
    vocab_size: int
    model_name: str
    max_request_tokens: int | None = None  # the work one request may start (None: 4 x max_len)
    tool_parser: str | None = None  # --enable-auto-tool-choice's --tool-call-parser: tool_choice auto (None: refused)
    sampling_defaults: tuple[
        tuple[str, float], ...
    ] = ()  # --generation-config auto: the model's, where a request is silent
    reasoning_parser: str | None = None  # --reasoning-parser: a chat grammar applies after the reasoning

    @property
    def request_budget(self) -> int:
        return 4 * self.max_len if self.max_request_tokens is None else self.max_request_tokens


def check_context(prompt_len: int, max_tokens: int, limits: Limits, where: str) -> None:
    """Prompt plus completion must fit the context and the KV pool; `where` is "prompt" or "messages"."""
    total = prompt_len + max_tokens
    if total > limits.max_len:
        raise APIError(
            400,
            f"This model's maximum context length is {limits.max_len} tokens. However, you requested {total} "
            f"tokens ({prompt_len} in the {where}, {max_tokens} in the completion). Please reduce the length of "
            f"the {where} or completion.",
            param=where,
            code="context_length_exceeded",
        )
    if total > limits.kv_tokens:
        raise APIError(
            400,
            f"The request needs {total} tokens of KV cache ({prompt_len} in the {where}, {max_tokens} in the "
            f"completion) but the KV pool holds {limits.kv_tokens}. Reduce max_tokens or the {where}, or start "
            "the server with a larger --kv-cache-memory.",
            param="max_tokens",
        )


def check_budget(prompt_len: int, max_tokens: int, n: int, best_of: int, limits: Limits) -> None:
    """Every sequence a request starts computes its prompt and up to `max_tokens`: together at most the budget
    (`--max-request-tokens`), so that one request cannot take more than its share of the ring (as vLLM caps
    `best_of`)."""
    work = best_of * (prompt_len + max_tokens)
    if work > limits.request_budget:
        param = "best_of" if best_of > n else "n"
        raise APIError(
            400,
            f"The request asks for {best_of} sequence(s) x ({prompt_len} prompt + {max_tokens} completion "
            f"tokens) = {work} tokens of work; one request may ask for at most {limits.request_budget} "
            "(--max-request-tokens). Lower n, best_of or max_tokens.",
            param=param,
            code="request_too_large",
        )


def check_stop_ids(params: SamplingParams, limits: Limits) -> SamplingParams:
    """Token ids in the parameters (stop ids, logit_bias keys) must be in the vocabulary."""
    for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", [i for i, _ in params.logit_bias])):
        bad = [i for i in ids if i >= limits.vocab_size]
        if bad:
            raise APIError(
                400, f"{name} has ids outside the vocabulary [0, {limits.vocab_size}): {bad[:5]}", param=name
            )
    return params


def encode_within(tok: Tokenizer, text: str, limits: Limits, param: str) -> list[int]:
    """Tokenize, refusing at once a text too long to fit the context whatever its tokens (no token covers more
    than `tok.max_token_chars` characters), so that a huge prompt costs no tokenization."""
    if len(text) > limits.max_len * tok.max_token_chars:
        raise APIError(
            400,
            f"This model's maximum context length is {limits.max_len} tokens. However, your {param} has "
            f"{len(text)} characters, more than {limits.max_len} tokens can hold. Please reduce the length of the "
            f"{param}.",
            param=param,
            code="context_length_exceeded",
        )
    return tok.encode(text)


def check_ids(ids: list[int], limits: Limits, param: str) -> list[int]:
    if not ids:
        raise APIError(400, f"{param} is empty; give at least one token", param=param)
    bad = [i for i in ids if not 0 <= i < limits.vocab_size]
    if bad:
        raise APIError(400, f"{param} has token ids outside [0, {limits.vocab_size}): {bad[:5]}", param=param)
    return ids


def default_max_tokens(prompt_len: int, limits: Limits) -> int:
    """As vLLM: no max_tokens means up to the context's end (at least 1, so the check reports the overflow)."""
    return max(min(limits.max_len, limits.kv_tokens) - prompt_len, 1)


SAMPLING_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def model_sampling_defaults(model_dir: str) -> tuple[tuple[str, float], ...]:
    """The sampling fields of the model's generation_config.json (`--generation-config auto`, as vLLM)."""
    import json
    from pathlib import Path

    path = Path(model_dir) / "generation_config.json"
    try:
        gen = json.loads(path.read_text()) if path.is_file() else {}
    except ValueError:
        return ()
    return tuple((k, gen[k]) for k in SAMPLING_DEFAULT_FIELDS if isinstance(gen.get(k), (int, float)))
