"""n > 1 by fork: the samples of one prompt share its KV blocks.

The first sample (the leader) computes the prompt up to, not including, its last token; then
each sibling forks the leader's blocks (refcount + 1) and every sample computes the last prompt
token itself, so each samples its own first token. The shared, partly filled last block is
copied on the first write (copy-on-write), so the divergence costs at most one block per sample.
"""

from __future__ import annotations

import dataclasses

from octavo.kv_cache.manager import KVCacheManager
from octavo.request import Request, RequestStatus


@dataclasses.dataclass(slots=True, eq=False)
class _Group:
    leader: Request
    held: list[Request] = dataclasses.field(default_factory=list)


class SiblingForks:
    """Holds siblings until their leader's prompt KV is ready, then forks them."""

    def __init__(self, kv_cache_manager: KVCacheManager):
        self.kv_cache_manager = kv_cache_manager
        self._groups: dict[str, _Group] = {}
        self._group_of_leader: dict[str, str] = {}
        self._held_ids: set[str] = set()
        self._forked: list[Request] = []
        self._released: list[Request] = []

    def add(self, request: Request, group_id: str) -> bool:
        """Register a sample; True when it should be queued now (a leader, or a prompt of one
        token, which has nothing to share), False when it waits to fork."""
        group = self._groups.get(group_id)
        if request.num_prompt_tokens < 2:
            return True
        if group is None:
            self._groups[group_id] = _Group(request)
            self._group_of_leader[request.request_id] = group_id
            return True
        group.held.append(request)
        self._held_ids.add(request.request_id)
        return False

    def __contains__(self, request: Request) -> bool:
        return request.request_id in self._held_ids

    @property
    def num_waiting(self) -> int:
        return len(self._held_ids)

    def cap(self, request: Request, num_new: int, num_computed: int | None = None) -> int:
        """Limit a leader with waiting siblings to its prompt minus the last token. When nothing
        is left to compute before the fork (a prefix-cache hit covered it), the siblings are
        released to run on their own: they hit the same cached blocks."""
        group_id = self._group_of_leader.get(request.request_id)
        if group_id is None:
            return num_new
        computed = request.num_computed_tokens if num_computed is None else num_computed
        limit = request.num_prompt_tokens - 1 - computed
        if limit <= 0:
            self._release(group_id)
            return num_new
        return min(num_new, limit)

    def fork_ready_leaders(self, room: int) -> None:
        """After a step: fork the siblings of every leader whose prompt (but the last token) has
        KV now, as many as ``room`` (free places in the running batch) allows; the others are
        released to wait for a place like any request (with prefix caching they hit the prompt's
        blocks)."""
        for group_id in list(self._group_of_leader.values()):
            group = self._groups[group_id]
            leader = group.leader
            if (
                leader.status != RequestStatus.RUNNING
                or leader.num_computed_tokens != leader.num_prompt_tokens - 1
            ):
                continue
            num_forked = max(0, min(room, len(group.held)))
            for child in group.held[:num_forked]:
                child.num_computed_tokens = leader.num_computed_tokens
                self.kv_cache_manager.fork(leader, child)
                child.status = RequestStatus.RUNNING
                self._forked.append(child)
            room -= num_forked
            self._released.extend(group.held[num_forked:])
            self._drop(group_id)

    def take_forked(self) -> list[Request]:
        """Siblings forked since the last call: they join the running requests at once."""
        forked, self._forked = self._forked, []
        return forked

    def take_released(self) -> list[Request]:
        """Siblings released since the last call: they join the waiting queue at once."""
        released, self._released = self._released, []
        return released

    def leader_finished(self, request: Request) -> None:
        """A leader ended before forking (e.g. aborted): its siblings run on their own."""
        group_id = self._group_of_leader.get(request.request_id)
        if group_id is not None:
            self._release(group_id)

    def discard(self, request: Request) -> None:
        """Forget a held sibling (aborted before it forked)."""
        self._held_ids.discard(request.request_id)
        for group in self._groups.values():
            if request in group.held:
                group.held.remove(request)

    def _release(self, group_id: str) -> None:
        self._released.extend(self._groups[group_id].held)
        self._drop(group_id)

    def _drop(self, group_id: str) -> None:
        group = self._groups.pop(group_id)
        self._group_of_leader.pop(group.leader.request_id, None)
        self._held_ids.difference_update(child.request_id for child in group.held)
