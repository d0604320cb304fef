"""`--reasoning-parser`: a thinking model's reasoning apart from its answer, as `reasoning_content` beside `content`
(vLLM's and SGLang's field), whole and streamed.

- `deepseek_r1`: everything before `</think>` is reasoning (DeepSeek-R1's template ends the prompt with `<think>`,
  so the output starts inside it; a leading `<think>` is dropped); without `</think>` all of it is.
- `qwen3`: reasoning only when the output starts with `<think>` (Qwen3 writes it when thinking; with
  `enable_thinking: false` its template puts an empty block in the prompt and the output is all answer).

A stream is split as it comes: text that may be the start of a tag waits for the next piece, so a tag cut anywhere
between two pieces is still found, and the pieces of a stream join up to the whole text's split.
"""

from __future__ import annotations

START, END = "<think>", "</think>"
PARSERS = ("deepseek_r1", "qwen3")


def _held(text: str, tag: str) -> int:
    """How many characters at the end of `text` could begin `tag` (kept back until the next piece)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningSplit:
    """One sequence's text, split as it streams: `feed(piece)` gives (reasoning, content) to send now; `finish()`
    what was held back at the end."""

    def __init__(self, parser: str) -> None:
        if parser not in PARSERS:
            raise ValueError(f"--reasoning-parser {parser!r}: use one of {', '.join(PARSERS)}")
        self.parser = parser
        self.state = "opening"  # opening (a leading <think> may come), reasoning, content
        self.buf = ""

    def feed(self, piece: str) -> tuple[str, str]:
        self.buf += piece
        reasoning = content = ""
        if self.state == "opening":
            stripped = self.buf.lstrip()
            if START.startswith(stripped) and len(stripped) < len(START):
                return "", ""  # still possibly the opening tag
            if stripped.startswith(START):
                self.buf, self.state = stripped[len(START) :], "reasoning"
            else:
                self.state = "reasoning" if self.parser == "deepseek_r1" else "content"
        if self.state == "reasoning":
            at = self.buf.find(END)
            if at < 0:
                keep = _held(self.buf, END)
                reasoning, self.buf = self.buf[: len(self.buf) - keep], self.buf[len(self.buf) - keep :]
                return reasoning, ""
            reasoning, self.buf, self.state = self.buf[:at], self.buf[at + len(END) :], "content"
        content, self.buf = self.buf, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """The text held back: a tag's start that never completed is text of the part it was in."""
        rest, self.buf = self.buf, ""
        if self.state == "opening":
            return ("", rest) if self.parser == "qwen3" else (rest, "")
        return (rest, "") if self.state == "reasoning" else ("", rest)


def split_whole(parser: str, text: str) -> tuple[str | None, str]:
    """(reasoning or None, content) of a whole output: what a stream of it gives, joined."""
    s = ReasoningSplit(parser)
    r1, c1 = s.feed(text)
    r2, c2 = s.finish()
    return (r1 + r2) or None, c1 + c2


def grammar_after(tok, prompt_ids: list[int]) -> tuple[int, ...]:
    """The tokens after which a reasoning answer's grammar applies (`SamplingParams.grammar_after`): the end tag's,
    or none where the prompt itself ends with a closed reasoning block (Qwen3's template with `enable_thinking:
    false` ends it with an empty one), so the answer starts at once."""
    end = tuple(tok.encode(END, add_bos=False))
    start = tuple(tok.encode(START, add_bos=False))
    at, opened = _last(prompt_ids, end), _last(prompt_ids, start)
    if at >= 0 and at > opened and not tok.decode(prompt_ids[at + len(end) :]).strip():
        return ()
    return end


def _last(ids: list[int], tag: tuple[int, ...]) -> int:
    """Where `tag` last starts in `ids`, or -1."""
    n = len(tag)
    for i in range(len(ids) - n, -1, -1):
        if tuple(ids[i : i + n]) == tag:
            return i
    return -1
