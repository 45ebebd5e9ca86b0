"""n > 1 by fork: the child requests of one parent request share its prompt's KV blocks.

A user request with ``n`` samples is a parent with ``n`` children (one engine request each, see
``octavo.outputs.processor``). The first child computes the prompt up to, not including, its last
token; then each other child forks the first child's blocks (refcount + 1) and every child
computes the last prompt token itself, so each samples its own first token. The shared, partly
filled last block is copied on the first write (copy-on-write), so the divergence costs at most
one block per child.
"""

from __future__ import annotations

import dataclasses

from octavo.kv_cache.manager import KVCacheManager
from octavo.request import Request, RequestStatus


@dataclasses.dataclass(slots=True, eq=False)
class _Family:
    first: Request  # the child that computes the shared prompt
    waiting: list[Request] = dataclasses.field(default_factory=list)  # the others, to fork


class ChildForks:
    """Holds a parent's other children until its first child's prompt KV is ready, then forks
    them from it."""

    def __init__(self, kv_cache_manager: KVCacheManager):
        self.kv_cache_manager = kv_cache_manager
        self._families: dict[str, _Family] = {}  # parent request id -> family
        self._parent_of_first: dict[str, str] = {}  # first child's id -> parent request id
        self._waiting_ids: set[str] = set()
        self._forked: list[Request] = []
        self._released: list[Request] = []

    def add(self, request: Request, parent_id: str) -> bool:
        """Register a child of ``parent_id``; True when it should be queued now (the first
        child, or a prompt of one token, which has nothing to share), False when it waits to
        fork."""
        family = self._families.get(parent_id)
        if request.num_prompt_tokens < 2:
            return True
        if family is None:
            self._families[parent_id] = _Family(request)
            self._parent_of_first[request.request_id] = parent_id
            return True
        family.waiting.append(request)
        self._waiting_ids.add(request.request_id)
        return False

    def __contains__(self, request: Request) -> bool:
        """True while ``request`` waits to fork."""
        return request.request_id in self._waiting_ids

    @property
    def num_waiting(self) -> int:
        """Children waiting to fork."""
        return len(self._waiting_ids)

    def cap(self, request: Request, num_new: int, num_computed: int | None = None) -> int:
        """Limit a first child with children waiting on it to its prompt minus the last token.
        When nothing is left to compute before the fork (a prefix-cache hit covered it), the
        others are released to run on their own: they hit the same cached blocks."""
        parent_id = self._parent_of_first.get(request.request_id)
        if parent_id is None:
            return num_new
        computed = request.num_computed_tokens if num_computed is None else num_computed
        limit = request.num_prompt_tokens - 1 - computed
        if limit <= 0:
            self._release(parent_id)
            return num_new
        return min(num_new, limit)

    def fork_ready(self, room: int) -> None:
        """After a step: fork the waiting children of every first child whose prompt (but the
        last token) has KV now, as many as ``room`` (free places in the running batch) allows;
        the others are released to wait for a place like any request (with prefix caching they
        hit the prompt's blocks)."""
        for parent_id in list(self._parent_of_first.values()):
            family = self._families[parent_id]
            first = family.first
            if (
                first.status != RequestStatus.RUNNING
                or first.num_computed_tokens != first.num_prompt_tokens - 1
            ):
                continue
            num_forked = max(0, min(room, len(family.waiting)))
            for child in family.waiting[:num_forked]:
                child.num_computed_tokens = first.num_computed_tokens
                self.kv_cache_manager.fork(first, child)
                child.status = RequestStatus.RUNNING
                self._forked.append(child)
            room -= num_forked
            self._released.extend(family.waiting[num_forked:])
            self._drop(parent_id)

    def take_forked(self) -> list[Request]:
        """Children forked since the last call: they join the running requests at once."""
        forked, self._forked = self._forked, []
        return forked

    def take_released(self) -> list[Request]:
        """Children released since the last call: they join the waiting queue at once."""
        released, self._released = self._released, []
        return released

    def first_child_finished(self, request: Request) -> None:
        """A first child ended before the fork (e.g. aborted): the others run on their own."""
        parent_id = self._parent_of_first.get(request.request_id)
        if parent_id is not None:
            self._release(parent_id)

    def discard(self, request: Request) -> None:
        """Forget a waiting child (aborted before it forked)."""
        self._waiting_ids.discard(request.request_id)
        for family in self._families.values():
            if request in family.waiting:
                family.waiting.remove(request)

    def _release(self, parent_id: str) -> None:
        self._released.extend(self._families[parent_id].waiting)
        self._drop(parent_id)

    def _drop(self, parent_id: str) -> None:
        family = self._families.pop(parent_id)
        self._parent_of_first.pop(family.first.request_id, None)
        self._waiting_ids.difference_update(child.request_id for child in family.waiting)
