"""Per request, the target's hidden states at the positions whose draft-head KV is not written
yet (``HeadBacklog``).

An EAGLE-style head's KV at position p is computed from the target's hidden state at p and the
token at p + 1. While drafts are off (the adaptive policy measured them slower at this batch
size, or ``disable_by_batch_size``), a head pass every step only to keep that KV current costs
as much as a quarter of a decode step on a small model, and nothing reads it until drafts are on
again. The proposer keeps the hidden states here instead and writes their KV in one pass later:
before the request drafts again, before its blocks go (it finished: they may be reused through
the prefix cache) and whenever the backlog passes its cap.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Iterator

import torch


@dataclasses.dataclass(frozen=True)
class Piece:
    """``count`` consecutive positions from ``first``, their hidden states rows ``start ..`` of
    ``kept`` (a step's copy, shared by the rows of that step)."""

    kept: torch.Tensor
    start: int
    first: int
    count: int

    @property
    def end(self) -> int:
        return self.first + self.count

    def hidden(self) -> torch.Tensor:
        return self.kept[self.start : self.start + self.count]

    def truncated(self, end: int) -> "Piece":
        return dataclasses.replace(self, count=min(self.count, end - self.first))


@dataclasses.dataclass(frozen=True)
class Run:
    """Consecutive positions of one request: ``first``, ``count`` and their hidden states."""

    first: int
    count: int
    hidden: list[torch.Tensor]


class HeadBacklog:
    """The kept positions of each request, in position order (see the module docstring)."""

    def __init__(self) -> None:
        self._pieces: dict[str, list[Piece]] = {}
        self.num_positions = 0

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._pieces

    def __len__(self) -> int:
        return len(self._pieces)

    def add(self, req_id: str, piece: Piece) -> None:
        """Keep ``piece`` after the request's positions before it (``trim`` first)."""
        self._pieces.setdefault(req_id, []).append(piece)
        self.num_positions += piece.count

    def trim(self, req_id: str, end: int) -> None:
        """Drop the request's positions from ``end`` on: they were not verified, or are being
        computed again."""
        pieces = self._pieces.get(req_id)
        while pieces and pieces[-1].end > end:
            last = pieces.pop()
            self.num_positions -= last.count
            if last.first < end:
                pieces.append(last.truncated(end))
                self.num_positions += end - last.first
        if pieces == []:
            del self._pieces[req_id]

    def drop_newest(self, req_id: str) -> None:
        """Drop the request's newest piece (its last step's positions)."""
        pieces = self._pieces.get(req_id)
        if pieces:
            self.num_positions -= pieces.pop().count
            if not pieces:
                del self._pieces[req_id]

    def pop(self, req_id: str) -> list[Run]:
        """The request's kept positions as runs of consecutive ones, no longer kept."""
        pieces = self._pieces.pop(req_id, [])
        self.num_positions -= sum(p.count for p in pieces)
        return list(_runs(pieces))

    def forget(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            self.num_positions -= sum(p.count for p in self._pieces.pop(req_id, []))


def _runs(pieces: list[Piece]) -> Iterator[Run]:
    first, count, hidden = 0, 0, []
    for piece in pieces:
        if hidden and piece.first != first + count:
            yield Run(first, count, hidden)
            hidden = []
        if not hidden:
            first, count = piece.first, 0
        count += piece.count
        hidden.append(piece.hidden())
    if hidden:
        yield Run(first, count, hidden)
