"""Per request, the target's hidden states at the positions whose draft-head KV is not written
yet (``HeadBacklog``).

An EAGLE-style head's KV at position p is computed from the target's hidden state at p and the
token at p + 1. While drafts are off (the adaptive policy measured them slower at this batch
size, or ``disable_by_batch_size``), a head pass every step only to keep that KV current costs
as much as a quarter of a decode step on a small model, and nothing reads it until drafts are on
again. The proposer keeps the hidden states here instead and writes their KV in one pass later:
before the request drafts again and whenever the backlog passes its cap. When the request
finishes, what it kept moves to ``PendingHeadKV``: its blocks may be read again through the
prefix cache, but most never are.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Iterator, Optional, Sequence

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
        return Piece(self.kept, self.start, self.first, min(self.count, end - self.first))


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


class PendingHeadKV:
    """Finished requests' kept positions whose head KV no one may ever read, by block.

    A finished request's blocks go to the prefix cache. The head's KV at its kept positions
    is needed only if a later request reuses one of those blocks through a prefix-cache hit and
    drafts; most blocks are never hit (a batch of distinct prompts) and are reused for other
    tokens. So the positions wait here, block by block: a request whose cached prefix holds
    such a block gets them written before its first head pass reads them (``pop``), and a block
    computed again (reused) drops them (``drop``). Past ``max_positions`` the oldest go: a
    later hit on their block drafts from missing head KV there (acceptance, never tokens).
    """

    def __init__(self, block_size: int, max_positions: int) -> None:
        self.block_size, self.max_positions = block_size, max_positions
        self._blocks: dict[int, tuple[int, torch.Tensor]] = {}  # id -> (first offset, hidden)
        self.num_positions = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def add(self, block_ids: Sequence[int], runs: Iterable[Run]) -> None:
        """Keep ``runs`` (of one request whose block table is ``block_ids``), block by block:
        a copy, so that the steps' tensors they were cut from can go."""
        bs = self.block_size
        for run in runs:
            hidden = torch.cat(run.hidden) if len(run.hidden) > 1 else run.hidden[0]
            position, end = run.first, run.first + run.count
            while position < end:
                index = position // bs
                stop = min(end, (index + 1) * bs)
                rows = hidden[position - run.first : stop - run.first]
                self._put(block_ids[index], position - index * bs, rows.clone())
                position = stop
        while self.num_positions > self.max_positions:
            self._pop_block(next(iter(self._blocks)))

    def _put(self, block_id: int, offset: int, hidden: torch.Tensor) -> None:
        self._pop_block(block_id)  # a block's positions come from one request
        self._blocks[block_id] = (offset, hidden)
        self.num_positions += len(hidden)

    def _pop_block(self, block_id: int) -> Optional[tuple[int, torch.Tensor]]:
        entry = self._blocks.pop(block_id, None)
        if entry is not None:
            self.num_positions -= len(entry[1])
        return entry

    def drop(self, block_ids: Iterable[int]) -> None:
        """Forget the positions of blocks that are being computed again."""
        for block_id in block_ids:
            self._pop_block(block_id)

    def pop(self, block_ids: Sequence[int]) -> list[Run]:
        """The positions kept for the blocks ``block_ids`` (a request's block table, the blocks
        ``0 .. len - 1`` of its context), as runs in that request's positions; no longer kept."""
        runs: list[Run] = []
        for index, block_id in enumerate(block_ids):
            entry = self._pop_block(block_id)
            if entry is None:
                continue
            first = index * self.block_size + entry[0]
            if runs and runs[-1].first + runs[-1].count == first:
                last = runs.pop()
                runs.append(Run(last.first, last.count + len(entry[1]), [*last.hidden, entry[1]]))
            else:
                runs.append(Run(first, len(entry[1]), [entry[1]]))
        return runs
