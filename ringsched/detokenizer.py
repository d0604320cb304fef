"""Token ids to streamed text: incremental, UTF-8 safe, with stop strings that never leak.

Contract: `TextStream(tokenizer, prompt_ids, stop).add(token_ids)` returns the text that may be shown now and
whether a stop string was hit; `finish()` returns what was held back when the request ends without a stop
string. The concatenation of everything returned equals the decoded completion, cut before the first stop
string when one appears.

Two things are held back: an incomplete UTF-8 character (a byte-level BPE token can carry half of one, which
decodes to "\\ufffd" until the rest arrives), and a tail of text that could still grow into a stop string.
"""

from __future__ import annotations

from collections.abc import Sequence

from ringsched.tokenizer import Tokenizer

# Prompt tokens decoded with the first generated ones: SentencePiece tokenizers drop a word's leading space
# when it starts the decoded text, so the first word needs a little left context to come out right.
_CONTEXT_TOKENS = 4
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Decodes a growing list of ids into text deltas, emitting a character only once it is complete.

    Only a short window (the previous delta's tokens plus the new ones) is decoded per step, so a step costs
    O(new tokens), not O(all tokens), as in vLLM's and Hugging Face's streamers."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = list(prompt_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0  # start of the window that is decoded for context
        self.read_offset = len(self.ids)  # tokens before this are already emitted as text

    def add(self, new_ids: Sequence[int]) -> str:
        self.ids.extend(new_ids)
        return self._step(final=False)

    def flush(self) -> str:
        """At the end: whatever is left, incomplete characters included (as "\\ufffd")."""
        return self._step(final=True)

    def _step(self, final: bool) -> str:
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset], self.skip)
        full = self.tokenizer.decode(self.ids[self.prefix_offset :], self.skip)
        if len(full) <= len(prefix) or (full.endswith(_REPLACEMENT) and not final):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full[len(prefix) :]


class StopMatcher:
    """Finds stop strings in streamed text, even when one spans several deltas, and never emits any part of
    one: text that ends in a prefix of a stop string is held until it is known not to be one."""

    def __init__(self, stop: Sequence[str]) -> None:
        self.stop = [s for s in stop if s]
        self.held = ""
        self.matched: str | None = None

    def feed(self, text: str) -> str:
        """Text safe to emit; once a stop string is found, `matched` is set and everything after is dropped."""
        if self.matched is not None or not text:
            return ""
        if not self.stop:
            return text
        buf = self.held + text
        hits = [(buf.find(s), s) for s in self.stop if s in buf]
        if hits:
            idx, self.matched = min(hits)
            self.held = ""
            return buf[:idx]
        keep = self._tail_len(buf)
        self.held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        held, self.held = self.held, ""
        return "" if self.matched is not None else held

    def _tail_len(self, buf: str) -> int:
        """Length of the longest suffix of `buf` that is a proper prefix of some stop string."""
        best, last = 0, buf[-1]
        for s in self.stop:
            k = min(len(s) - 1, len(buf))
            while k > best:
                # Only a prefix that ends in `buf`'s last character can match: jump to the longest such one.
                k = s.rfind(last, 0, k) + 1
                if k <= best:
                    break
                if buf.endswith(s[:k]):
                    best = k
                    break
                k -= 1
        return best


class TextStream:
    """Detokenizer then stop matcher: the text of one request as it may be shown."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), stop: Sequence[str] = ()) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids)
        self.stops = StopMatcher(stop)
        self.text = ""  # everything emitted so far

    @property
    def stopped(self) -> bool:
        return self.stops.matched is not None

    def add(self, token_ids: Sequence[int]) -> str:
        return self._emit(self.stops.feed(self.detok.add(token_ids)))

    def add_until_stop(self, token_ids: Sequence[int]) -> tuple[str, int]:
        """`add`, a token at a time once there are stop strings, up to the token that completes one: the text and
        how many of `token_ids` it took (a speculative step's tokens can run past a stop string)."""
        if len(token_ids) <= 1 or not self.stops.stop:
            return self.add(token_ids), len(token_ids)
        text = ""
        for i, tok in enumerate(token_ids):
            text += self.add([tok])
            if self.stopped:
                return text, i + 1
        return text, len(token_ids)

    def finish(self) -> str:
        """The held-back rest when the request ended on its own (eos, stop token, length)."""
        out = self.stops.feed(self.detok.flush())
        return self._emit(out + self.stops.flush())

    def _emit(self, text: str) -> str:
        self.text += text
        return text
