"""The n-gram proposer (prompt lookup): a request's drafts are what followed the latest earlier
occurrence of its last n tokens, for the longest n in ``[prompt_lookup_min, prompt_lookup_max]``
that occurs earlier in its prompt + output.

Array operations over the whole batch: one shifted comparison per n, none per token or per
request.
"""

from __future__ import annotations

import numpy as np

from octavo.spec_decode.proposer import ProposeContext


def propose_ngram(
    token_ids: np.ndarray, num_tokens: np.ndarray, min_n: int, max_n: int, k: int
) -> tuple[np.ndarray, np.ndarray]:
    """Drafts for each row of ``token_ids [R, L]`` (row ``r`` holds ``num_tokens[r]`` tokens):
    ``(drafts [R, k] int64, num_drafts [R])``; row ``r``'s drafts are ``drafts[r, :num_drafts[r]]``
    (0 when no n-gram of its suffix occurs earlier). The continuation stops at the row's end.

    ``run[r, e]`` counts how many of the row's last tokens match, backwards, the tokens ending at
    position ``e`` (at most ``max_n``): one shifted comparison per n, over the whole batch."""
    num_rows = len(num_tokens)
    drafts = np.zeros((num_rows, k), dtype=np.int64)
    num_drafts = np.zeros(num_rows, dtype=np.int64)
    lengths = num_tokens.astype(np.int64)
    width = int(lengths.max()) if num_rows else 0
    if width < 2:
        return drafts, num_drafts
    tokens = token_ids[:, :width]
    rows = np.arange(num_rows)
    run = np.zeros((num_rows, width), dtype=np.int64)
    alive = np.ones((num_rows, width), dtype=bool)
    for j in range(min(max_n, width)):  # no match is longer than the row
        back = lengths - 1 - j  # the row's j-th token from its end
        wanted = tokens[rows, np.maximum(back, 0)]
        alive[:, j:] &= tokens[:, : width - j] == wanted[:, None]
        alive[:, :j] = False
        alive &= (back >= 0)[:, None]
        run += alive
    # A match must leave a token after it (its continuation), so it is never the suffix itself.
    run[np.arange(width)[None, :] >= lengths[:, None] - 1] = 0
    best = run.max(axis=1)
    hit = best >= min_n
    latest = width - 1 - np.argmax((run >= best[:, None])[:, ::-1], axis=1)
    start = latest + 1
    index = np.minimum(start[:, None] + np.arange(k), lengths[:, None] - 1)
    drafts[hit] = np.take_along_axis(tokens, index, axis=1)[hit]
    num_drafts[hit] = np.minimum(k, lengths - start)[hit]
    return drafts, num_drafts


class NgramProposer:
    """``speculative_config.method == "ngram"``."""

    needs_lookahead_slots = False
    recompute_last_cached_block = False
    attention_layers: list = []

    def __init__(self, min_n: int, max_n: int, num_speculative_tokens: int):
        self.min_n, self.max_n, self.k = min_n, max_n, num_speculative_tokens

    def forward_step(self, step, hidden_states) -> None:
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
