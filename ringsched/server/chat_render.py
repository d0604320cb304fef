"""A chat request's messages through the model's chat template: roles checked, text parts joined, earlier turns'
tool calls and the request's tools and `chat_template_kwargs` given to it (`tokenizer.Tokenizer.render_chat`)."""

from __future__ import annotations

from ringsched.server.errors import APIError, shown
from ringsched.server.request_bodies import ROLES, ChatRequest
from ringsched.server.request_limits import Limits
from ringsched.server.tools import ToolUse, template_messages
from ringsched.tokenizer import ChatTemplateError, Tokenizer

RESERVED_TEMPLATE_NAMES = {"messages", "add_generation_prompt", "bos_token", "eos_token", "tools"}  # the server's


def render_chat(
    req: ChatRequest, tok: Tokenizer, limits: Limits, add_generation_prompt: bool = True, tools: ToolUse | None = None
) -> list[int]:
    """The messages' token ids (of `req.messages`, with their tool calls) through the model's chat template, the
    tools given to it; a 400 naming the message at fault, or the context length when their text cannot fit
    whatever it tokenizes to."""
    messages = []
    for i, m in enumerate(req.messages):
        if m.role not in ROLES:
            raise APIError(
                400,
                f"messages[{i}].role {shown(m.role)} is not a known role; use one of {', '.join(ROLES)}",
                param=f"messages[{i}].role",
            )
        text = m.content if isinstance(m.content, str) or m.content is None else "".join(p.text for p in m.content)
        messages.append({"role": m.role, "content": text or ""})
    chars = sum(len(m["content"]) for m in messages)
    if chars > limits.max_len * tok.max_token_chars:  # no rendering or tokenizing of what cannot fit anyway
        raise APIError(
            400,
            f"This model's maximum context length is {limits.max_len} tokens. However, your messages have "
            f"{chars} characters, more than {limits.max_len} tokens can hold. Please reduce the length of the "
            "messages.",
            param="messages",
            code="context_length_exceeded",
        )
    messages = template_messages(messages, req.messages)
    extra = getattr(req, "chat_template_kwargs", None) or {}
    reserved = sorted(set(extra) & RESERVED_TEMPLATE_NAMES)
    if reserved:
        raise APIError(400, f"chat_template_kwargs may not set {', '.join(reserved)}", param="chat_template_kwargs")
    if tools is not None:
        extra = {**extra, "tools": tools.tools}
    if getattr(req, "reasoning_effort", None) is not None:
        extra = {"reasoning_effort": req.reasoning_effort, **extra}
    try:
        return tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **extra)
    except ChatTemplateError as e:  # the model's template is at fault, not the request
        raise APIError(500, str(e), "internal_server_error", code="chat_template_error") from None
    except ValueError as e:  # the template refused these messages, or the model has none
        raise APIError(
            400, f"the messages could not be rendered with the chat template: {e}", param="messages"
        ) from None
