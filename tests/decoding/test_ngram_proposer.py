"""Prompt lookup: the longest matching suffix, its latest earlier occurrence, what followed it."""

from __future__ import annotations

import random

from tokenriver.decoding.ngram import find_continuation


def brute_force_continuation(token_ids: list[int], ngram_min: int, ngram_max: int, limit: int) -> list[int]:
    """The rule, spelled out with list slices."""
    for n in range(min(ngram_max, len(token_ids) - 1), ngram_min - 1, -1):
        suffix = token_ids[-n:]
        for start in range(len(token_ids) - n - 1, -1, -1):
            if token_ids[start : start + n] == suffix:
                return token_ids[start + n : start + n + limit]
    return []


def test_longest_suffix_wins_over_a_later_shorter_match():
    tokens = [1, 2, 3, 4, 9, 3, 4, 7, 2, 3, 4]
    # "2 3 4" occurred at 1 (followed by 9); "3 4" occurred later at 5 (followed by 7): the longer match wins.
    assert find_continuation(tokens, 1, 3, 3) == [9, 3, 4]
    assert find_continuation(tokens, 1, 2, 3) == [7, 2, 3]


def test_latest_occurrence_and_limit():
    tokens = [5, 6, 1, 5, 6, 2, 5, 6]
    assert find_continuation(tokens, 2, 2, 1) == [2]
    assert find_continuation(tokens, 2, 2, 5) == [2, 5, 6]
    assert find_continuation(tokens, 2, 2, 0) == []


def test_no_match_and_too_short():
    assert find_continuation([1, 2, 3, 4], 2, 4, 4) == []
    assert find_continuation([7], 1, 3, 4) == []
    assert find_continuation([7, 7], 1, 3, 4) == [7]


def test_byte_search_never_matches_across_token_boundaries():
    # Token ids whose little-endian bytes could line up across two neighbours: 256 = 00 01 00 00, 1 = 01 00 00 00.
    tokens = [256, 65536, 1, 0, 1, 8, 256]
    assert find_continuation(tokens, 1, 1, 2) == brute_force_continuation(tokens, 1, 1, 2) == [65536, 1]


def test_matches_brute_force_on_random_sequences():
    rng = random.Random(0)
    for _ in range(500):
        tokens = [rng.choice([3, 4, 5, 256, 70000]) for _ in range(rng.randint(1, 40))]
        ngram_min = rng.randint(1, 3)
        ngram_max = rng.randint(ngram_min, 5)
        limit = rng.randint(1, 6)
        assert find_continuation(tokens, ngram_min, ngram_max, limit) == brute_force_continuation(
            tokens, ngram_min, ngram_max, limit
        )
