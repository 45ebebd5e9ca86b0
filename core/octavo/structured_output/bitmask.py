"""The runner's logits processor for constrained requests: one packed bitmask for the
constrained positions of the step, filled by each request's xgrammar matcher and applied with
the platform's bitmask kernel; the matchers advance on the tokens the step emits.

A row verifying drafts appears once per draft position: its matcher takes the drafts before
each position, fills that position's mask, and gives them back afterwards (a draft the grammar
refuses makes the positions after it unconstrained: they are never reached, the draft being
masked out at its own position). Free requests are never touched.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable

import numpy as np
import torch

logger = logging.getLogger(__name__)


class GrammarBitmask:
    """``fn(logits, batch, rows, num_tokens)`` as the runner's other logits processors."""

    def __init__(
        self,
        backend: Callable[[], Any],
        requests: dict,
        apply_bitmask: Callable[..., None],
    ):
        """``backend()`` gives the GrammarBackend (built on first use); ``requests`` are the
        runner's request states; ``apply_bitmask`` is the platform's kernel."""
        self.backend, self.requests, self.apply_bitmask = backend, requests, apply_bitmask
        self.matchers: dict[str, Any] = {}

    def _matcher(self, req_id: str) -> Any:
        matcher = self.matchers.get(req_id)
        if matcher is None:
            state = self.requests[req_id]
            matcher = self.backend().matcher(state.sampling_params.structured_outputs)
            for token in state.output_token_ids:  # tokens generated before it was made
                matcher.accept_token(token)
            self.matchers[req_id] = matcher
        return matcher

    def applies_to(self, batch, rows: np.ndarray) -> bool:
        return bool(batch.constrained[rows].any())

    def __call__(self, logits: torch.Tensor, batch, rows: np.ndarray, num_tokens: np.ndarray):
        positions = np.flatnonzero(batch.constrained[rows])
        if len(positions) == 0:
            return logits
        backend = self.backend()
        bitmask = backend.allocate_bitmask(len(positions))
        row_of = rows[positions]
        if (num_tokens[positions] == batch.num_tokens[row_of]).all():  # no drafts: one each
            matchers = [self._matcher(batch.req_ids[row]) for row in row_of.tolist()]
            live = [i for i, matcher in enumerate(matchers) if not matcher.is_terminated()]
            if live:  # a terminated grammar (EOS ignored) leaves its row free
                backend.batch_fill([matchers[i] for i in live], bitmask, live)
        else:
            start = 0
            while start < len(positions):  # one request's positions are consecutive
                end = start + 1
                while end < len(positions) and row_of[end] == row_of[start]:
                    end += 1
                row = int(row_of[start])
                self._fill(batch, row, num_tokens[positions[start:end]], bitmask, start)
                start = end
        bitmask = bitmask.to(logits.device)
        if len(positions) == logits.shape[0]:  # every row constrained
            self.apply_bitmask(logits, bitmask)
        else:
            self.apply_bitmask(logits, bitmask, torch.from_numpy(positions).to(logits.device))
        return logits

    def _fill(self, batch, row: int, num_tokens: np.ndarray, bitmask, first: int) -> None:
        """Fill the masks of one request's positions (``num_tokens``: the tokens before each)."""
        matcher = self._matcher(batch.req_ids[row])
        emitted = int(batch.num_tokens[row])
        taken = 0
        last = first + len(num_tokens)
        for i, before in enumerate(num_tokens.tolist()):
            while taken < before - emitted:  # a draft before this position
                if not matcher.accept_token(int(batch.token_ids[row, emitted + taken])):
                    break
                taken += 1
            if taken < before - emitted or matcher.is_terminated():
                # Unreachable: a draft above is refused (masked out at its own position), or
                # it ends the grammar (a stop token: the output ends there).
                bitmask[first + i : last] = -1
                break
            matcher.fill_next_token_bitmask(bitmask, first + i)
        if taken:
            matcher.rollback(taken)

    def accept_emitted(self, batch, rows: np.ndarray, emitted: list[list[int]]) -> None:
        """Advance the matchers of the constrained ``rows`` on the tokens they emitted."""
        for row, tokens in zip(rows.tolist(), emitted):
            if batch.constrained[row]:
                matcher = self._matcher(batch.req_ids[row])
                for token in tokens:
                    if matcher.is_terminated():
                        break  # EOS ignored after the grammar's end: the rest is free
                    if not matcher.accept_token(token):
                        logger.warning(
                            "request %s emitted token %d its grammar refuses",
                            batch.req_ids[row],
                            token,
                        )

    def forget(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            self.matchers.pop(req_id, None)
