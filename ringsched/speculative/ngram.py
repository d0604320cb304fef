"""N-gram prompt lookup (vLLM's `ngram` method): the draft is what followed the last time the request's newest
`n` tokens appeared in its prompt or output, for the largest `n` in `[prompt_lookup_min, prompt_lookup_max]` that
appeared before.

`NgramIndex` keeps, per `n`, the end position of the latest earlier occurrence of every n-gram, updated as tokens
are appended (`n_max - n_min + 1` dictionary writes a token), so a proposal is `n_max - n_min + 1` lookups, not a
scan of the context. The latest occurrence is taken (vLLM takes the first): in a passage being repeated or edited
the latest copy is the one being followed. A continuation that reaches the end of the tokens goes on as they
repeat (a latest occurrence `p` tokens back predicts a period of `p`), so a loop of a few tokens drafts `k`.
"""

from __future__ import annotations


class NgramIndex:
    """One request's tokens (prompt, then output as it is accepted) and its n-gram positions."""

    def __init__(self, tokens: list[int], n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max
        self.tokens: list[int] = []
        # n -> n-gram -> end index of its latest occurrence that is not the newest suffix
        self.seen: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(n_min, n_max + 1)}
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        for t in tokens:
            self._index_suffix()  # the suffix ending at the current last token becomes an earlier occurrence
            self.tokens.append(t)

    def _index_suffix(self) -> None:
        end = len(self.tokens)
        for n, table in self.seen.items():
            if end >= n:
                table[tuple(self.tokens[end - n : end])] = end - 1

    def propose(self, k: int) -> list[int]:
        """Up to `k` draft tokens: those after the latest earlier occurrence of the longest matching suffix."""
        end = len(self.tokens)
        for n in range(min(self.n_max, end), self.n_min - 1, -1):
            at = self.seen[n].get(tuple(self.tokens[end - n :]))
            if at is not None:  # what followed it, to the end; then, as the tokens repeat with that period, again
                period = end - 1 - at
                return [self.tokens[at + 1 + i % period] for i in range(k)]
        return []
