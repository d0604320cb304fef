"""Structured outputs through llguidance (a Rust grammar engine on PyPI as one abi3 wheel with no dependencies;
it runs on CPU, computes a token mask in ~1-3 ms and needs no compile step for JSON schemas, where xgrammar pulls
in torch's compile stack and a C++ build of each grammar).

`grammar_for(...)` turns what a request asks for (a JSON schema, any JSON object, a regex, a choice of strings,
a Lark grammar) into one llguidance grammar string, which travels in `SamplingParams.grammar`; `check(grammar)`
returns the error a request should be refused with. On the last stage, `Constraint` holds one request's matcher:
`allowed()` is the boolean mask of the tokens the grammar admits next and `advance(token)` moves it on. The
matcher is built when the plan announces the request, on the last stage, in plan order, on a worker thread
(`Grammars.build`); the request's first sampling waits for it, so every stage sees the grammar ready at the same
plan, and stage 0 schedules the request as soon as it is admitted.
"""

from __future__ import annotations

import json
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

# JSON without optional whitespace: a small model given the choice otherwise pads with spaces and newlines.
JSON_OPTIONS = {"whitespace_flexible": False}


class GrammarError(ValueError):
    pass


def _llguidance():
    try:
        import llguidance
    except ImportError as e:  # pragma: no cover (a dependency of the package)
        raise GrammarError("structured outputs need the llguidance package: pip install llguidance") from e
    return llguidance


def grammar_for(
    json_schema: Any = None,
    json_object: bool = False,
    regex: str | None = None,
    choice: list[str] | None = None,
    lark: str | None = None,
) -> str:
    """One llguidance grammar from exactly one of the forms; raises GrammarError on a malformed one."""
    m = _llguidance().LLMatcher
    given = [x for x in (json_schema, regex, choice, lark) if x is not None] + ([True] if json_object else [])
    if len(given) != 1:
        raise GrammarError("give exactly one of a JSON schema, a JSON object, a regex, a choice and a grammar")
    try:
        if json_object:
            return m.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if json_schema is not None:
            schema = json.loads(json_schema) if isinstance(json_schema, str) else json_schema
            if not isinstance(schema, dict):
                raise GrammarError("a JSON schema must be a JSON object")
            return m.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        if regex is not None:
            return m.grammar_from_regex(regex)
        if choice is not None:
            if not choice or not all(isinstance(c, str) and c for c in choice):
                raise GrammarError("a choice must be a non-empty list of non-empty strings")
            return m.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choice))
        return m.grammar_from_lark(lark)
    except (ValueError, TypeError) as e:
        raise GrammarError(str(e)) from None


def check(grammar: str) -> str:
    """The grammar's error ('' when it is valid)."""
    error = _llguidance().LLMatcher.validate_grammar(grammar)
    return "" if error.startswith("WARNING") else error


class Grammars:
    """The last stage's llguidance tokenizer, built on the first structured request (~0.4 s for a 49k vocabulary),
    and a `Constraint` per request: `build` makes one on a worker thread, so the stage's loop goes on with its
    steps while a grammar compiles; the request's first sampling waits for it (a grammar the server proved
    in a helper process compiles within `--grammar-timeout`)."""

    def __init__(self, model_dir: str | Path, vocab_size: int, eos_ids: tuple[int, ...]) -> None:
        self.path, self.vocab_size, self.eos_ids = Path(model_dir) / "tokenizer.json", vocab_size, eos_ids
        self._tokenizer = None
        self._worker: ThreadPoolExecutor | None = None

    def build(self, grammar: str, after: tuple[int, ...] = ()) -> Future[Constraint]:
        """`constraint(grammar)` with its first mask computed, on this stage's grammar thread; with `after`, one
        that applies only once the output has those tokens (`AfterTokens`)."""
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        return self._worker.submit(self._ready, grammar, after)

    def _ready(self, grammar: str, after: tuple[int, ...]) -> Constraint:
        c = self.constraint(grammar)
        c.mask()
        return AfterTokens(c, after) if after else c

    def constraint(self, grammar: str) -> Constraint:
        llg = _llguidance()
        if self._tokenizer is None:
            eos = list(self.eos_ids) or None
            self._tokenizer = llg.LLTokenizer(str(self.path), n_vocab=self.vocab_size, eos_token=eos)
        return Constraint(llg.LLMatcher(self._tokenizer, grammar, log_level=0), self.vocab_size)


class Constraint:
    """One request's grammar state on the last stage."""

    def __init__(self, matcher, vocab_size: int) -> None:
        import llguidance.numpy as lnp

        self.matcher, self.vocab_size, self._lnp = matcher, vocab_size, lnp
        self._bitmask = lnp.allocate_token_bitmask(1, vocab_size)
        self._next: np.ndarray | None = None  # the mask until the next `advance`
        if matcher.is_error():
            raise GrammarError(matcher.get_error())

    def mask(self) -> np.ndarray:
        """`[vocab]` bool: the tokens the grammar admits next (only EOS once it is complete)."""
        if self._next is None:
            self._lnp.fill_next_token_bitmask(self.matcher, self._bitmask, 0)
            bits = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")[: self.vocab_size]
            self._next = bits.astype(bool)
        return self._next

    def allowed(self) -> torch.Tensor:
        """`mask()` as a tensor."""
        import torch  # here, not above: the grammar helper processes import this module and need no torch

        return torch.from_numpy(self.mask())

    def advance(self, token: int) -> None:
        self._next = None
        if not self.matcher.consume_token(token):
            raise GrammarError(f"token {token} broke the grammar: {self.matcher.get_error()}")

    def admits(self, tokens: list[int]) -> int:
        """How many of `tokens` in a row the grammar admits from here (its state unchanged)."""
        return self.matcher.validate_tokens(tokens)

    def masks_along(self, tokens: list[int]) -> tuple[int, list[torch.Tensor]]:
        """Speculative drafts `tokens`: how many of them in a row the grammar admits (`v`), and its `allowed()` before
        each of those and after them (`v + 1` masks); the state is left as it was."""
        v = self.matcher.validate_tokens(tokens)
        masks = [self.allowed()]
        for tok in tokens[:v]:
            self.advance(tok)
            masks.append(self.allowed())
        if v:
            self._next = None
            self.matcher.rollback(v)
        return v, masks


class AfterTokens:
    """A grammar that applies once the output holds `after` (`SamplingParams.grammar_after`: a reasoning parser's
    end tag): every token is admitted before, the grammar's from the token after them on. It has `Constraint`'s
    methods, so the sampler does not ask which it holds."""

    def __init__(self, inner: Constraint, after: tuple[int, ...]) -> None:
        self.inner, self.after = inner, tuple(after)
        self.active = False
        self.tail: list[int] = []  # the last tokens before the grammar applies, up to len(after)
        self._all = np.ones(inner.vocab_size, dtype=bool)

    def mask(self) -> np.ndarray:
        return self.inner.mask() if self.active else self._all

    def allowed(self) -> torch.Tensor:
        import torch

        return torch.from_numpy(self.mask())

    def advance(self, token: int) -> None:
        if self.active:
            self.inner.advance(token)
            return
        self.tail = (self.tail + [token])[-len(self.after) :]
        self.active = tuple(self.tail) == self.after

    def admits(self, tokens: list[int]) -> int:
        return self._along(tokens, masks=None)

    def masks_along(self, tokens: list[int]) -> tuple[int, list[torch.Tensor]]:
        masks = [self.allowed()]
        return self._along(tokens, masks), masks

    def _along(self, tokens: list[int], masks: list | None) -> int:
        """How many of `tokens` in a row are admitted (with `masks`, the mask after each is appended); the state
        is left as it was."""
        active, tail, inner = self.active, list(self.tail), 0
        n = 0
        for tok in tokens:
            if self.active:
                if not self.inner.admits([tok]):
                    break
                inner += 1
            self.advance(tok)
            n += 1
            if masks is not None:
                masks.append(self.allowed())
        if inner:
            self.inner._next = None
            self.inner.matcher.rollback(inner)
        self.active, self.tail = active, tail
        return n
