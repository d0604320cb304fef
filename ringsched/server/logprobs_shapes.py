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


def prompt_logprobs(tok: Tokenizer, prompt_ids: list[int], scores: list | None) -> list | None:
    """vLLM's `prompt_logprobs`: None for the first prompt token, then per token a map from token id (a string, as
    JSON keys are) to its log-probability, rank and text: the prompt token's own, and the most likely ones'."""
    if scores is None:
        return None
    out: list[dict | None] = [None]
    for token_id, (logprob, rank, top) in zip(prompt_ids[1:], scores, strict=True):
        entry = {str(token_id): {"logprob": logprob, "rank": rank, "decoded_token": _piece(tok, token_id)}}
        for r, (i, v) in enumerate(top, start=1):
            entry.setdefault(str(i), {"logprob": v, "rank": r, "decoded_token": _piece(tok, i)})
        out.append(entry)
    return out


def echoed_logprobs(tok: Tokenizer, prompt_ids: list[int], scores: list, k: int) -> dict:
    """Completions with `echo` and `logprobs`: the completions shape of the prompt's tokens (the first has no
    log-probability, None as OpenAI's), its `k` most likely tokens at each; `completion_logprobs` continues it."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = 0
    for j, token_id in enumerate(prompt_ids):
        piece = _piece(tok, token_id)
        logprob, top = None, None
        if j:
            logprob, _, best = scores[j - 1]
            top = {**{_piece(tok, i): v for i, v in best[:k]}, piece: logprob}
        out["tokens"].append(piece)
        out["token_logprobs"].append(logprob)
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        offset += len(piece)
    return out


def joined(first: dict, then: dict | None) -> dict:
    """Two pieces of the completions shape, one after the other."""
    return {key: first[key] + (then[key] if then else []) for key in first}
