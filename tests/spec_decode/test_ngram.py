"""The n-gram proposer against a plain-Python statement of prompt lookup."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from octavo.spec_decode.ngram import propose_ngram


def lookup_oracle(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The longest n in [min_n, max_n] whose last-n-token suffix occurs earlier with a token
    after it; the up-to-k tokens after its latest such occurrence."""
    length = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if length <= n:
            continue
        suffix = tokens[length - n :]
        for start in range(length - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


rows = st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=24), min_size=1, max_size=6)


@settings(max_examples=300, deadline=None)
@given(rows, st.integers(1, 3), st.integers(0, 2), st.integers(1, 5))
def test_batched_lookup_equals_the_oracle_row_by_row(token_rows, min_n, extra, k):
    max_n = min_n + extra
    width = max(len(r) for r in token_rows) + 3
    token_ids = np.full((len(token_rows), width), 7, dtype=np.int32)  # padding never matches
    for i, r in enumerate(token_rows):
        token_ids[i, : len(r)] = r
    num_tokens = np.array([len(r) for r in token_rows])
    drafts, num_drafts = propose_ngram(token_ids, num_tokens, min_n, max_n, k)
    for i, r in enumerate(token_rows):
        assert drafts[i, : num_drafts[i]].tolist() == lookup_oracle(r, min_n, max_n, k)


def test_the_longest_match_wins_and_its_latest_occurrence():
    # suffix (1, 2): the 2-gram occurs at 0 and 4; the latest (4) is followed by 9, 9
    tokens = [1, 2, 5, 6, 1, 2, 9, 9, 8, 2, 1, 2]
    drafts, num = propose_ngram(np.array([tokens]), np.array([len(tokens)]), 1, 2, 3)
    assert drafts[0, : num[0]].tolist() == [9, 9, 8]
