"""Request validation, the OpenAI way: every bad request becomes an `APIError` before it reaches the ring.

Contract: `parse_completion`, `parse_chat` and `parse_generate` take the decoded JSON body and return a
`Prepared` request (prompt token ids, `SamplingParams`, stream flags) or raise `APIError`, whose `body()` is
OpenAI's `{"error": {"message", "type", "param", "code"}}`. Field types are checked strictly (a string is not a
number, a float is not an int), values by `SamplingParams`, and prompt plus completion against the context
length with OpenAI's message.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

from pydantic import BaseModel, ValidationError

from ringsched.sampling.params import SamplingParams
from ringsched.server.chat_render import render_chat
from ringsched.server.errors import APIError, shown
from ringsched.server.grammar_request import Asked, asked_grammar
from ringsched.server.reasoning import grammar_after as reasoning_grammar_after
from ringsched.server.request_bodies import (
    ACCEPTED,
    MAX_N,
    OPENAI_FIELDS,
    UNSUPPORTED,
    ChatRequest,
    CompletionRequest,
    GenerateRequest,
    SamplingBody,
)
from ringsched.server.request_limits import (
    Limits,
    check_budget,
    check_context,
    check_ids,
    check_stop_ids,
    default_max_tokens,
    encode_within,
)
from ringsched.server.tools import ToolUse, tool_use
from ringsched.tokenizer import Tokenizer

logger = logging.getLogger("ringsched.server")


@dataclass
class Prepared:
    """A validated request, ready for the engine. With `n` (or `best_of`) > 1 it runs as that many sequences on the
    ring (`sequences`): the same prompt, whose KV the prefix cache shares, each with its own seed."""

    prompt_ids: list[int]
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    n: int = 1
    best_of: int = 1  # sequences to run; the `n` with the highest cumulative log-probability are returned
    logprobs_asked: bool = True  # False: log-probabilities were added only to rank `best_of`; not returned
    grammar: Asked | None = None  # a structured-output constraint, not yet proven (`grammar_pool.py`)
    tools: ToolUse | None = None  # the chat request's tools (`tools.py`)
    echo: str | None = None  # completions with `echo`: the prompt's text, put before each choice's
    prompt_logprobs: bool = False  # the response carries `prompt_logprobs` (vLLM's field)

    def sequences(self, rid: str) -> list[tuple[str, SamplingParams]]:
        """(request id, params) of each sequence: `rid` alone for one; `rid-i` with seed + i (when seeded) else."""
        if self.best_of == 1:
            return [(rid, self.params)]
        seed = self.params.seed
        return [
            (f"{rid}-{i}", self.params if seed is None else replace(self.params, seed=(seed + i) % 2**64))
            for i in range(self.best_of)
        ]


# -- parsing -------------------------------------------------------------------------------------------------
def _validate(model: type[BaseModel], body: dict) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        param = _param(err["loc"])
        got = repr(err.get("input"))
        got = got if len(got) <= 200 else got[:200] + f"... ({len(got)} characters)"
        raise APIError(400, f"{param}: {err['msg']} (got {got})", param=param) from None


def _param(loc: tuple) -> str:
    """`messages[0].role` from pydantic's `('messages', 0, 'role')`; union member tags are dropped."""
    out = str(loc[0])
    if out == "messages" and len(loc) > 1 and isinstance(loc[1], int):
        out += f"[{loc[1]}]"
        if len(loc) > 2 and loc[2] in ("role", "content", "name"):
            out += f".{loc[2]}"
    return out


def _check_common(body: dict, req: SamplingBody, limits: Limits, endpoint: str) -> None:
    for name, allowed in UNSUPPORTED.items():
        if name in body and body[name] not in allowed:
            raise APIError(400, f"{name}={shown(body[name])} is not supported by this server", param=name)
    ignored = sorted(set(req.model_extra or ()) - set(OPENAI_FIELDS[endpoint]) - set(UNSUPPORTED) - ACCEPTED)
    if ignored:  # as vLLM: accepted, and said so
        logger.warning("The following fields were present in the request but ignored: %s", ignored)
    check_model(req.model, limits)


def check_model(model: str | None, limits: Limits) -> None:
    """A request naming another model than the one served: OpenAI's 404."""
    if model is not None and model != limits.model_name:
        raise APIError(
            404,
            f"The model {shown(model)} does not exist; this server serves `{limits.model_name}`",
            param="model",
            code="model_not_found",
        )


def _params(fields: dict[str, Any], rename: dict[str, str] | None = None) -> SamplingParams:
    """SamplingParams from the fields that were given; its ValueError starts with the field's name."""
    given = {k: v for k, v in fields.items() if v is not None}
    try:
        return SamplingParams(**given)
    except (ValueError, TypeError) as e:
        msg = str(e)
        name = msg.split()[0] if msg else ""
        shown = (rename or {}).get(name, name)
        raise APIError(400, shown + msg[len(name) :], param=shown or None) from None


def _sampling_fields(req: SamplingBody, max_tokens: int, limits: Limits) -> dict[str, Any]:
    """The request's sampling fields; the model's defaults (`--generation-config auto`) where it is silent."""
    fields = {
        "max_tokens": max_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "seed": req.seed,
        "stop": req.stop,
        "stop_token_ids": req.stop_token_ids,
        "ignore_eos": req.ignore_eos,
        "repetition_penalty": req.repetition_penalty,
        "min_tokens": req.min_tokens,
        "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
        "logit_bias": req.logit_bias,
        "prompt_logprobs": req.prompt_logprobs,
    }
    if req.prompt_logprobs is not None and req.stream:  # as vLLM: the prompt's come whole, not streamed
        raise APIError(
            400, "prompt_logprobs are not returned when streaming: drop one of them", param="prompt_logprobs"
        )
    return fields | {k: v for k, v in limits.sampling_defaults if fields[k] is None}


def _counts(n: int | None, best_of: int | None, stream: bool) -> tuple[int, int]:
    """`n` and `best_of` checked: 1 <= n <= best_of <= MAX_N, and no streaming of a best_of > n."""
    n = 1 if n is None else n
    if not 1 <= n <= MAX_N:
        raise APIError(400, f"n must be in [1, {MAX_N}], got {n}", param="n")
    best_of = n if best_of is None else best_of
    if not n <= best_of <= MAX_N:
        raise APIError(400, f"best_of must be in [n={n}, {MAX_N}], got {best_of}", param="best_of")
    if stream and best_of > n:
        raise APIError(400, "best_of > n cannot be streamed: the best are known only at the end", param="best_of")
    return n, best_of


def parse_completion(body: dict, tok: Tokenizer, limits: Limits) -> Prepared:
    req: CompletionRequest = _validate(CompletionRequest, body)
    _check_common(body, req, limits, "completions")
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise APIError(400, f"batched prompts are not supported: send {len(prompt)} requests", param="prompt")
        prompt = prompt[0]
    ids = check_ids(
        encode_within(tok, prompt, limits, "prompt") if isinstance(prompt, str) else list(prompt), limits, "prompt"
    )
    max_tokens = req.max_tokens if req.max_tokens is not None else 16  # OpenAI's default for completions
    n, best_of = _counts(req.n, req.best_of, req.stream)
    logprobs = req.logprobs if req.logprobs is not None or best_of == n else 0  # best_of ranks by them
    fields = {**_sampling_fields(req, max_tokens, limits), "logprobs": logprobs}
    if req.echo and req.logprobs is not None:  # the echoed prompt's tokens come with theirs
        fields["prompt_logprobs"] = max(req.prompt_logprobs or 0, req.logprobs)
    params = check_stop_ids(_params(fields), limits)
    check_context(len(ids), max_tokens, limits, "prompt")
    check_budget(len(ids), max_tokens, n, best_of, limits)
    echo = (prompt if isinstance(prompt, str) else tok.decode(ids, skip_special_tokens=False)) if req.echo else None
    return Prepared(
        ids,
        params,
        req.stream,
        bool(req.stream_options and req.stream_options.include_usage),
        n,
        best_of,
        req.logprobs is not None,
        asked_grammar(req),
        echo=echo,
        prompt_logprobs=req.prompt_logprobs is not None,
    )


def parse_chat(body: dict, tok: Tokenizer, limits: Limits) -> Prepared:
    req: ChatRequest = _validate(ChatRequest, body)
    _check_common(body, req, limits, "chat")
    tools = tool_use(req, limits.tool_parser)
    grammar = asked_grammar(req)
    if tools is not None and tools.constrained:
        if grammar is not None:
            raise APIError(
                400,
                f"tool_choice {tools.choice} and {grammar.field} both constrain the answer; give one",
                param=grammar.field,
            )
        grammar = tools.grammar()
    ids = render_chat(req, tok, limits, tools=tools)
    check_ids(ids, limits, "messages")
    given = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_tokens = given if given is not None else default_max_tokens(len(ids), limits)
    name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = _params(
        {**_sampling_fields(req, max_tokens, limits), "logprobs": logprobs},
        {"max_tokens": name, "logprobs": "top_logprobs"},
    )
    if grammar is not None and limits.reasoning_parser:  # the grammar constrains the answer, not the reasoning
        params = replace(params, grammar_after=reasoning_grammar_after(tok, ids))
    params = check_stop_ids(params, limits)
    check_context(len(ids), max_tokens, limits, "messages")
    n, _ = _counts(req.n, None, req.stream)
    check_budget(len(ids), max_tokens, n, n, limits)
    return Prepared(
        ids,
        params,
        req.stream,
        bool(req.stream_options and req.stream_options.include_usage),
        n,
        n,
        grammar=grammar,
        tools=tools,
        prompt_logprobs=req.prompt_logprobs is not None,
    )


_GENERATE_RENAME = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "sampling_seed": "seed"}
_GENERATE_KEYS = set(_GENERATE_RENAME) | {
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "repetition_penalty",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
}


def parse_generate(body: dict, tok: Tokenizer, limits: Limits) -> Prepared:
    """SGLang's native `/generate`: `text` or `input_ids`, `sampling_params` with SGLang's names."""
    req: GenerateRequest = _validate(GenerateRequest, body)
    if (req.text is None) == (req.input_ids is None):
        raise APIError(400, "give exactly one of `text` and `input_ids`", param="text")
    unknown = sorted(set(req.sampling_params) - _GENERATE_KEYS)
    if unknown:
        known = sorted(_GENERATE_KEYS)
        raise APIError(400, f"unknown sampling_params {unknown}; known: {known}", param="sampling_params")
    text_ids = encode_within(tok, req.text, limits, "text") if req.text is not None else None
    where = "text" if text_ids is not None else "input_ids"
    ids = check_ids(text_ids if text_ids is not None else list(req.input_ids), limits, where)
    fields = {_GENERATE_RENAME.get(k, k): v for k, v in req.sampling_params.items()}
    fields.setdefault("max_tokens", 128)  # SGLang's default max_new_tokens
    shown = {_GENERATE_RENAME[k]: k for k in req.sampling_params if k in _GENERATE_RENAME}  # the name it came as
    params = check_stop_ids(_params(fields, shown), limits)
    check_context(len(ids), params.max_tokens, limits, "prompt")
    check_budget(len(ids), params.max_tokens, 1, 1, limits)
    return Prepared(ids, params, req.stream)
