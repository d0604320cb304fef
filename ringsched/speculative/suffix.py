"""Suffix decoding (SuffixDecoding; vLLM's `suffix` method): drafts from suffix trees of what was already
written, the request's own prompt and output and the outputs of recent requests, each continuation weighted by how
often it followed.

`SuffixTree` is a trie of every substring of at most `depth` tokens of the sequences added to it, each node
counting the occurrences of its substring, so `count(child) / count(node)` is how often a token followed. A draft
matches the longest suffix of the context in the tree (substrings are closed under taking suffixes, so the match
length is found by bisection), then follows the most frequent child while the product of those frequencies stays
at least `min_token_prob`, for at most `max_spec_factor` x the match length tokens (a long match is trusted
further). Its score is the sum of those products: the expected number of draft tokens accepted, by which the
request's tree and the shared one compete (`SuffixDrafter`).
"""

from __future__ import annotations

from collections import OrderedDict


class Node:
    __slots__ = ("children", "count", "depth")

    def __init__(self, depth: int) -> None:
        self.count = 0
        self.depth = depth
        self.children: dict[int, Node] = {}


class SuffixTree:
    """Substrings of at most `depth` tokens of the sequences added, with their counts; sequences by id, each
    growing by `extend` and taken out again whole by `remove`."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.root = Node(0)
        self.open: dict[object, list[Node]] = {}  # id -> the nodes of its suffixes still shorter than `depth`
        self.sequences: dict[object, list[int]] = {}

    def extend(self, seq_id: object, tokens: list[int]) -> None:
        active = self.open.setdefault(seq_id, [])
        self.sequences.setdefault(seq_id, []).extend(tokens)
        for t in tokens:
            grown = []
            for node in [*active, self.root]:  # every suffix ending here grows by t
                child = node.children.get(t)
                if child is None:
                    child = node.children[t] = Node(node.depth + 1)
                child.count += 1
                if child.depth < self.depth:
                    grown.append(child)
            active[:] = grown

    def close(self, seq_id: object) -> None:
        """The sequence will not grow: forget where its suffixes stand (its substrings stay)."""
        self.open.pop(seq_id, None)

    def remove(self, seq_id: object) -> None:
        """Take a sequence's substrings out again (counts down, empty nodes dropped)."""
        tokens = self.sequences.pop(seq_id, [])
        self.open.pop(seq_id, None)
        for start in range(len(tokens)):
            node = self.root
            for t in tokens[start : start + self.depth]:
                child = node.children[t]
                child.count -= 1
                if child.count == 0:
                    del node.children[t]
                    break
                node = child

    def _walk(self, tokens: list[int]) -> Node | None:
        node = self.root
        for t in tokens:
            node = node.children.get(t)
            if node is None:
                return None
        return node

    def match(self, context: list[int]) -> tuple[Node, int]:
        """The node of the longest suffix of `context` that the tree has seen followed by something (at most `depth`
        tokens; a request's own tree holds the context itself, whose whole suffix has no continuation), and its
        length. A suffix seen followed has every shorter suffix seen followed too, so bisection finds it."""
        lo, hi, best = 0, min(self.depth, len(context)), self.root
        while lo < hi:  # invariant: the suffix of length lo matches (length 0: the root)
            mid = (lo + hi + 1) // 2
            node = self._walk(context[len(context) - mid :])
            if node is None or not node.children:
                hi = mid - 1
            else:
                lo, best = mid, node
        return best, lo

    def speculate(self, context: list[int], k: int, spec_factor: float, min_prob: float) -> tuple[list[int], float]:
        """(draft tokens, score): at most `k` and `spec_factor` x the match length tokens."""
        node, matched = self.match(context)
        limit = min(k, int(spec_factor * matched))
        draft: list[int] = []
        prob, score = 1.0, 0.0
        while len(draft) < limit:
            if not node.children:  # the deepest substrings end here: match again with the draft appended
                node, again = self.match([*context, *draft])
                if again == 0 or not node.children:
                    break
            token, child = max(node.children.items(), key=lambda item: item[1].count)
            prob *= child.count / node.count
            if prob < min_prob:
                break
            draft.append(token)
            score += prob
            node = child
        return draft, score


class SuffixDrafter:
    """Stage 0's suffix drafts: a tree per running request (its prompt and output) and one shared by the outputs
    of the last `max_cached` finished requests; a draft comes from whichever scores higher."""

    def __init__(self, depth: int, max_cached: int, spec_factor: float, min_prob: float) -> None:
        self.depth, self.max_cached = depth, max_cached
        self.spec_factor, self.min_prob = spec_factor, min_prob
        self.shared = SuffixTree(depth)
        self.cached: OrderedDict[object, None] = OrderedDict()  # finished requests in the shared tree, oldest first
        self.own: dict[object, SuffixTree] = {}
        self.outputs: dict[object, int] = {}  # request -> where its output starts

    def start(self, req_id: object, prompt: list[int]) -> None:
        tree = self.own[req_id] = SuffixTree(self.depth)
        tree.extend(req_id, prompt)
        self.outputs[req_id] = len(prompt)

    def extend(self, req_id: object, tokens: list[int]) -> None:
        self.own[req_id].extend(req_id, tokens)

    def propose(self, req_id: object, k: int) -> list[int]:
        context = self.own[req_id].sequences[req_id]  # its prompt and output, as its tree holds them
        mine = self.own[req_id].speculate(context, k, self.spec_factor, self.min_prob)
        shared = self.shared.speculate(context, k, self.spec_factor, self.min_prob)
        return (mine if mine[1] >= shared[1] else shared)[0]

    def finish(self, req_id: object) -> None:
        """The request is done (or aborted): its output joins the shared tree, the oldest beyond `max_cached`
        leaves it."""
        context, start = self.own.pop(req_id).sequences[req_id], self.outputs.pop(req_id)
        if self.max_cached == 0 or len(context) == start:
            return
        self.shared.extend(req_id, context[start:])
        self.shared.close(req_id)
        self.cached[req_id] = None
        while len(self.cached) > self.max_cached:
            oldest, _ = self.cached.popitem(last=False)
            self.shared.remove(oldest)
