"""`POST /tokenize` and `POST /detokenize`, in vLLM's shapes: a prompt (or chat messages, rendered by the model's
chat template as `/v1/chat/completions` renders them) to token ids, and token ids back to text. Neither touches the
ring."""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, Field

from ringsched.server.chat_render import render_chat
from ringsched.server.protocol import APIError, Limits, _validate, check_model, shown
from ringsched.server.request_bodies import ChatMessage, Tool, _Strict
from ringsched.server.tools import ToolUse
from ringsched.tokenizer import Tokenizer


class TokenizeRequest(_Strict):
    model_config = ConfigDict(strict=True, extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    tools: list[Tool] | None = None  # given to the chat template, as a chat request's
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Strict):
    model_config = ConfigDict(strict=True, extra="forbid")
    model: str | None = None
    tokens: list[int]


def tokenize(body: dict, tok: Tokenizer, limits: Limits) -> dict:
    req: TokenizeRequest = _validate(TokenizeRequest, body)
    check_model(req.model, limits)
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "give either prompt (a text) or messages (a chat), not both or neither", param="prompt")
    if req.messages is not None:
        tools = ToolUse([t.model_dump(exclude_none=True) for t in req.tools], "none") if req.tools else None
        ids = render_chat(req, tok, limits, add_generation_prompt=req.add_generation_prompt, tools=tools)
    else:
        ids = tok.encode(req.prompt, add_bos=req.add_special_tokens)
    return {"count": len(ids), "max_model_len": limits.max_len, "tokens": ids}


def detokenize(body: dict, tok: Tokenizer, limits: Limits) -> dict:
    req: DetokenizeRequest = _validate(DetokenizeRequest, body)
    check_model(req.model, limits)
    bad = next((i for i, t in enumerate(req.tokens) if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise APIError(
            400,
            f"tokens[{bad}] = {shown(req.tokens[bad])} is not a token id of this model (0 to {limits.vocab_size - 1})",
            param="tokens",
        )
    return {"prompt": tok.decode(req.tokens, skip_special_tokens=False)}
