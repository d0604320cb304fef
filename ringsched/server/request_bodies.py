"""The request bodies as the API defines them: every field of OpenAI's two endpoints and SGLang's `/generate`,
typed strictly (pydantic, `strict=True`: a string is not a number, a float is not an int), with the fields this
server honours, accepts only at their default, or accepts as hints. `protocol.py` validates a body against them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

ROLES = ("system", "developer", "user", "assistant", "tool")

# Every field OpenAI's API reference defines for the two endpoints. Each is either honoured or, in `UNSUPPORTED`,
# accepted only with its default (any other value gets a 400 naming it: ignoring it would return something other
# than what was asked for). Identifiers and hints that cannot change the output (`user`, `metadata`,
# `safety_identifier`, `prompt_cache_key`, `parallel_tool_calls` without tools) are honoured by accepting them.
OPENAI_FIELDS = {
    "completions": (
        "model",
        "prompt",
        "best_of",
        "echo",
        "frequency_penalty",
        "logit_bias",
        "logprobs",
        "max_tokens",
        "n",
        "presence_penalty",
        "seed",
        "stop",
        "stream",
        "stream_options",
        "suffix",
        "temperature",
        "top_p",
        "user",
    ),
    "chat": (
        "messages",
        "model",
        "audio",
        "frequency_penalty",
        "function_call",
        "functions",
        "logit_bias",
        "logprobs",
        "max_completion_tokens",
        "max_tokens",
        "metadata",
        "modalities",
        "n",
        "parallel_tool_calls",
        "prediction",
        "presence_penalty",
        "prompt_cache_key",
        "reasoning_effort",
        "response_format",
        "safety_identifier",
        "seed",
        "service_tier",
        "stop",
        "store",
        "stream",
        "stream_options",
        "temperature",
        "tool_choice",
        "tools",
        "top_logprobs",
        "top_p",
        "user",
        "verbosity",
        "web_search_options",
    ),
}
UNSUPPORTED = {
    "suffix": (None, ""),
    "audio": (None,),
    "function_call": (None, "none"),
    "functions": (None, []),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "service_tier": (None, "auto", "default"),
    "store": (None, False),
    "verbosity": (None,),
    "web_search_options": (None,),
}
# vLLM's structured-output fields (beside OpenAI's `response_format`)
GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")
ACCEPTED = {"user", "metadata", "safety_identifier", "prompt_cache_key", "parallel_tool_calls", *GUIDED}


# -- request bodies ------------------------------------------------------------------------------------------
class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(_Strict):
    include_usage: bool = False


class SamplingBody(_Strict):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_tokens: int = 0
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's log-probability and the most likely there
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None


class CompletionRequest(SamplingBody):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool | None = None  # the prompt's text before the completion's
    logprobs: int | None = None  # the sampled token's and this many most likely tokens' log-probabilities
    best_of: int | None = None


class ContentPart(_Strict):
    type: Literal["text"]
    text: str


class ToolFunction(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: ToolFunction


class CalledFunction(_Strict):
    name: str
    arguments: str


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(_Strict):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn's answer to one


class ChatRequest(SamplingBody):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = Field(default=None, min_length=1)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None  # to the template (gpt-oss)
    chat_template_kwargs: dict[str, Any] | None = None  # more variables for the template (Qwen3's enable_thinking)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


class GenerateRequest(_Strict):
    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    stream: bool = False


MAX_N = 16  # sequences one request may ask for (n, best_of)
