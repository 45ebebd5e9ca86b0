"""The n-gram proposer (prompt lookup): a request's drafts are what followed the latest earlier
occurrence of its last n tokens, for the longest n in ``[prompt_lookup_min, prompt_lookup_max]``
that occurs earlier in its prompt + output.

Array operations over the whole batch: one pass per n, none per token or per request.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from octavo.spec_decode.proposer import ProposeContext


def propose_ngram(
    token_ids: np.ndarray, num_tokens: np.ndarray, min_n: int, max_n: int, k: int
) -> tuple[np.ndarray, np.ndarray]:
    """Drafts for each row of ``token_ids [R, L]`` (row ``r`` holds ``num_tokens[r]`` tokens):
    ``(drafts [R, k] int64, num_drafts [R])``; row ``r``'s drafts are ``drafts[r, :num_drafts[r]]``
    (0 when no n-gram of its suffix occurs earlier). The continuation stops at the row's end."""
    num_rows = len(num_tokens)
    drafts = np.zeros((num_rows, k), dtype=np.int64)
    num_drafts = np.zeros(num_rows, dtype=np.int64)
    if num_rows == 0:
        return drafts, num_drafts
    num_tokens = num_tokens.astype(np.int64)
    width = int(num_tokens.max())
    tokens = token_ids[:, :width]
    found = np.zeros(num_rows, dtype=bool)
    for n in range(max_n, min_n - 1, -1):
        rows = np.flatnonzero(~found & (num_tokens > n))
        if len(rows) == 0:
            continue
        row_tokens, lengths = tokens[rows], num_tokens[rows]
        suffix = np.take_along_axis(row_tokens, lengths[:, None] - n + np.arange(n), axis=1)
        windows = sliding_window_view(row_tokens, n, axis=1)  # [rows, width - n + 1, n]
        starts = np.arange(windows.shape[1])
        # A match must leave a token after it (its continuation), so it is never the suffix.
        match = (windows == suffix[:, None, :]).all(axis=2) & (starts + n < lengths[:, None])
        hit = match.any(axis=1)
        if not hit.any():
            continue
        latest = windows.shape[1] - 1 - np.argmax(match[:, ::-1], axis=1)
        continuation = latest + n
        count = np.minimum(k, lengths - continuation)
        index = np.minimum(continuation[:, None] + np.arange(k), lengths[:, None] - 1)
        hit_rows = rows[hit]
        drafts[hit_rows] = np.take_along_axis(row_tokens, index, axis=1)[hit]
        num_drafts[hit_rows] = count[hit]
        found[hit_rows] = True
    return drafts, num_drafts


class NgramProposer:
    """``speculative_config.method == "ngram"``."""

    needs_lookahead_slots = False
    attention_layers: list = []

    def __init__(self, min_n: int, max_n: int, num_speculative_tokens: int):
        self.min_n, self.max_n, self.k = min_n, max_n, num_speculative_tokens

    def forward_step(self, step) -> None:
        pass

    def draft_probs(self, batch, rows, num_drafts) -> None:
        return None  # each draft is a point mass

    def forget(self, req_ids) -> None:
        pass

    def propose(self, context: ProposeContext) -> tuple[np.ndarray, np.ndarray]:
        batch, rows = context.batch, context.rows
        return propose_ngram(
            batch.token_ids[rows], batch.num_tokens[rows], self.min_n, self.max_n, self.k
        )
