"""Counts of speculative decoding, kept by the scheduler as drafts are verified (cumulative; the
metrics layer exports differences, the engine logs the mean acceptance length)."""

from __future__ import annotations

import dataclasses
import logging
import time

logger = logging.getLogger("octavo.spec_decode")


@dataclasses.dataclass(slots=True)
class SpecDecodeStats:
    """``num_drafts``: verifications (one request-step with at least one draft);
    ``num_draft_tokens``/``num_accepted_tokens``: drafts scheduled and accepted;
    ``num_accepted_tokens_per_pos[i]``: how often draft ``i`` (0-based) was accepted."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = dataclasses.field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        per_pos = self.num_accepted_tokens_per_pos
        if len(per_pos) < num_accepted:
            per_pos.extend([0] * (num_accepted - len(per_pos)))
        for i in range(num_accepted):
            per_pos[i] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verification: 1 (the target's own token) + accepted drafts."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def since(self, earlier: "SpecDecodeStats") -> "SpecDecodeStats":
        """The counts added after ``earlier`` (a copy taken before)."""
        per_pos = list(self.num_accepted_tokens_per_pos)
        for i, count in enumerate(earlier.num_accepted_tokens_per_pos):
            per_pos[i] -= count
        return SpecDecodeStats(
            self.num_drafts - earlier.num_drafts,
            self.num_draft_tokens - earlier.num_draft_tokens,
            self.num_accepted_tokens - earlier.num_accepted_tokens,
            per_pos,
        )

    def copy(self) -> "SpecDecodeStats":
        return dataclasses.replace(
            self, num_accepted_tokens_per_pos=list(self.num_accepted_tokens_per_pos)
        )


class SpecDecodeLog:
    """Logs the mean acceptance length of the drafts verified since the previous line, at most
    once per ``interval_s`` (checked after each step: one clock read)."""

    def __init__(self, stats: SpecDecodeStats, interval_s: float = 10.0):
        self.stats, self.interval_s = stats, interval_s
        self._seen = stats.copy()
        self._next_at = time.monotonic() + interval_s

    def maybe_log(self) -> None:
        now = time.monotonic()
        if now < self._next_at or self.stats.num_drafts == self._seen.num_drafts:
            return
        new = self.stats.since(self._seen)
        per_pos = ", ".join(f"{c / new.num_drafts:.2f}" for c in new.num_accepted_tokens_per_pos)
        logger.info(
            "speculative decoding: mean acceptance length %.2f over %d drafts "
            "(%d of %d draft tokens accepted; acceptance per position: %s)",
            new.mean_acceptance_length,
            new.num_drafts,
            new.num_accepted_tokens,
            new.num_draft_tokens,
            per_pos or "none",
        )
        self._seen = self.stats.copy()
        self._next_at = now + self.interval_s
