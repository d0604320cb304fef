"""Log-probabilities in OpenAI's two response shapes: the completions shape (parallel lists) and the chat shape
(one entry per token)."""

from __future__ import annotations

from ringsched.tokenizer import Tokenizer


def _piece(tok: Tokenizer, token_id: int) -> str:
    return tok.decode([token_id], skip_special_tokens=False)


def completion_logprobs(tok: Tokenizer, lps: list, offset: int = 0) -> dict | None:
    """The completions shape: parallel lists of tokens, their log-probabilities, a map of the most likely tokens
    (the sampled one included, as OpenAI's and vLLM's) and character offsets into the completion."""
    if not lps:
        return None
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, logprob, top in lps:
        piece = _piece(tok, token_id)
        out["tokens"].append(piece)
        out["token_logprobs"].append(logprob)
        out["top_logprobs"].append({**{_piece(tok, i): v for i, v in top}, piece: logprob})
        out["text_offset"].append(offset)
        offset += len(piece)
    return out


def chat_logprobs(tok: Tokenizer, lps: list) -> dict | None:
    """The chat shape: per token its text, log-probability, UTF-8 bytes and `top_logprobs` of the same form."""
    if not lps:
        return None

    def entry(token_id: int, logprob: float) -> dict:
        piece = _piece(tok, token_id)
        return {"token": piece, "logprob": logprob, "bytes": list(piece.encode("utf-8"))}

    content = [{**entry(t, lp), "top_logprobs": [entry(i, v) for i, v in top]} for t, lp, top in lps]
    return {"content": content, "refusal": None}
