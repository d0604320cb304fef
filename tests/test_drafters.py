"""Speculative decoding's model-free drafters and their config: n-gram prompt lookup follows the latest earlier
occurrence of the longest matching suffix, kept incrementally; suffix trees count continuations, draft the most
frequent while likely enough, learn from finished requests and forget the oldest; `--speculative-config` takes
vLLM's JSON and names the field it refuses."""

from __future__ import annotations

import random

import pytest

from ringsched.speculative.config import SpeculativeConfig, SpeculativeConfigError
from ringsched.speculative.ngram import NgramIndex
from ringsched.speculative.suffix import SuffixDrafter, SuffixTree


def brute_ngram(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """The definition, by scanning: for the largest n, the latest earlier occurrence of the last n tokens."""
    for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
        tail = tokens[-n:]
        for end in range(len(tokens) - 2, n - 2, -1):
            if tokens[end - n + 1 : end + 1] == tail:  # then on as the tokens repeat with that period
                return [tokens[end + 1 + i % (len(tokens) - 1 - end)] for i in range(k)]
    return []


def test_ngram_drafts_what_followed_the_last_time():
    index = NgramIndex([1, 2, 3, 4, 5, 9, 2, 3], n_min=1, n_max=3)
    assert index.propose(3) == [4, 5, 9]
    index.extend([4, 7, 1, 2, 3])  # [2, 3] now last followed 4, 7; [1, 2, 3] followed 4, 5
    assert index.propose(2) == [4, 5]  # the longest match wins over the latest shorter one
    assert NgramIndex([5, 6, 7], 1, 3).propose(4) == []
    assert NgramIndex([5, 6, 7, 8, 7], 1, 3).propose(5) == [8, 7, 8, 7, 8]  # a loop of period 2 goes on


def test_ngram_kept_incrementally_equals_the_definition():
    rng = random.Random(0)
    for _ in range(50):
        tokens = [rng.randrange(6) for _ in range(rng.randrange(1, 60))]
        n_min = rng.randrange(1, 3)
        n_max = n_min + rng.randrange(0, 3)
        index = NgramIndex(tokens[:5], n_min, n_max)
        index.extend(tokens[5:])
        k = rng.randrange(1, 6)
        assert index.propose(k) == brute_ngram(tokens, k, n_min, n_max), (tokens, n_min, n_max, k)


def brute_count(seqs: list[list[int]], sub: list[int]) -> int:
    return sum(s[i : i + len(sub)] == sub for s in seqs for i in range(len(s) - len(sub) + 1))


def test_a_suffix_tree_counts_every_short_substring():
    rng = random.Random(1)
    seqs = [[rng.randrange(4) for _ in range(30)] for _ in range(3)]
    tree = SuffixTree(depth=5)
    for i, s in enumerate(seqs):
        tree.extend(i, s[:10])
        tree.extend(i, s[10:])
    for _ in range(200):
        s = rng.choice(seqs)
        a = rng.randrange(len(s))
        sub = s[a : a + rng.randrange(1, 6)]
        assert tree._walk(sub).count == brute_count(seqs, sub)
    assert tree._walk([0, 0, 0, 0, 0, 0]) is None  # deeper than `depth`: not kept


def test_a_suffix_draft_follows_the_most_frequent_continuation_while_likely():
    tree = SuffixTree(depth=8)
    tree.extend("a", [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 5])
    draft, score = tree.speculate([9, 1, 2], k=4, spec_factor=2.0, min_prob=0.1)
    assert draft == [3, 4, 1, 2] and score > 0  # after [1, 2]: 3 always; after [1, 2, 3]: 4 twice, 5 once
    strict, _ = tree.speculate([9, 1, 2], k=4, spec_factor=2.0, min_prob=0.9)
    assert strict == [3]  # 4 follows [1, 2, 3] two times in three: below 0.9
    short, _ = tree.speculate([9, 1, 2], k=4, spec_factor=1.0, min_prob=0.1)
    assert len(short) == 2  # a match of 2 tokens drafts at most 2 at factor 1
    assert tree.speculate([7, 7], k=4, spec_factor=1.0, min_prob=0.1)[0] == []


def test_a_requests_own_tree_drafts_from_an_earlier_occurrence_of_its_suffix():
    """The tree holds the context itself: the match is the longest suffix seen followed by something."""
    tree = SuffixTree(depth=24)
    context = [9, 10, 11, 12] * 6
    tree.extend("r", context)
    assert tree.speculate(context, k=5, spec_factor=1.0, min_prob=0.1)[0] == [9, 10, 11, 12, 9]


def test_removing_a_sequence_leaves_the_tree_as_if_never_added():
    rng = random.Random(2)
    seqs = {i: [rng.randrange(3) for _ in range(25)] for i in range(3)}
    tree, without = SuffixTree(6), SuffixTree(6)
    for i, s in seqs.items():
        tree.extend(i, s)
        if i != 1:
            without.extend(i, s)
    tree.remove(1)

    def shape(node):
        return node.count, {t: shape(c) for t, c in node.children.items()}

    assert shape(tree.root) == shape(without.root)


def test_the_drafter_learns_from_finished_requests_and_forgets_the_oldest():
    drafter = SuffixDrafter(depth=16, max_cached=1, spec_factor=1.0, min_prob=0.1)
    answer = [40, 41, 42, 43, 44, 45]
    drafter.start("r1", [1, 2, 3])
    drafter.extend("r1", answer)
    drafter.finish("r1")
    drafter.start("r2", [7, 8, 40, 41, 42])  # begins the answer r1 gave
    assert drafter.propose("r2", 3) == [43, 44, 45]
    drafter.finish("r2")  # its output is empty: nothing cached, r1 stays
    drafter.start("r3", [5])
    drafter.extend("r3", [50, 51])
    drafter.finish("r3")  # r1 leaves the cache (max_cached=1)
    drafter.start("r4", [40, 41, 42])
    assert drafter.propose("r4", 3) == []
    assert not drafter.own.keys() - {"r4"} and not drafter.shared.open


def test_the_config_takes_vllms_shape_and_names_what_it_refuses():
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}')
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (3, 3)
    assert SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2}).prompt_lookup_min == 5
    suffix = SpeculativeConfig.parse({"method": "suffix", "num_speculative_tokens": 8})
    assert suffix.suffix_decoding_max_tree_depth == 24 and suffix.suffix_decoding_min_token_prob == 0.1
    for bad, field in [("{", "not JSON"), ('{"method": "eagle", "num_speculative_tokens": 2}', "method"),
                       ('{"method": "ngram"}', "num_speculative_tokens"),
                       ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
                       ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, '
                        '"prompt_lookup_max": 2}', "prompt_lookup_min"),
                       ('{"method": "suffix", "num_speculative_tokens": 2, "suffix_decoding_min_token_prob": 2}',
                        "suffix_decoding_min_token_prob"),
                       ('{"method": "ngram", "num_speculative_tokens": 2, "draft_model": "x"}', "draft_model"),
                       ('{"method": "ngram", "num_speculative_tokens": 2, "adaptive": "no"}', "adaptive"),
                       ("[1]", "JSON object")]:  # fmt: skip
        with pytest.raises(SpeculativeConfigError, match=field):
            SpeculativeConfig.parse(bad)
