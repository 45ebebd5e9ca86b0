"""Waiting queues of the scheduler: first-come-first-served, or by priority."""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from typing import Iterator, Protocol


class Queued(Protocol):
    request_id: str
    priority: int
    arrival_time: float


class RequestQueue(Protocol):
    """What the scheduler needs of a waiting queue."""

    def add(self, request) -> None: ...

    def prepend(self, request) -> None: ...

    def peek(self): ...

    def pop(self): ...

    def remove(self, request) -> None: ...

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator: ...


class FCFSQueue:
    """Arrival order; a preempted request goes back to the front."""

    def __init__(self) -> None:
        self._queue: deque = deque()

    def add(self, request) -> None:
        self._queue.append(request)

    def prepend(self, request) -> None:
        self._queue.appendleft(request)

    def peek(self):
        return self._queue[0]

    def pop(self):
        return self._queue.popleft()

    def remove(self, request) -> None:
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator:
        return iter(self._queue)


class PriorityQueue:
    """Lowest ``priority`` value first (as vLLM), then earliest arrival."""

    def __init__(self) -> None:
        self._heap: list = []
        self._counter = itertools.count()

    def add(self, request) -> None:
        heapq.heappush(
            self._heap, (request.priority, request.arrival_time, next(self._counter), request)
        )

    prepend = add  # a preempted request keeps its priority and arrival time

    def peek(self):
        return self._heap[0][-1]

    def pop(self):
        return heapq.heappop(self._heap)[-1]

    def remove(self, request) -> None:
        self._heap = [entry for entry in self._heap if entry[-1] is not request]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator:
        return (entry[-1] for entry in sorted(self._heap))


def make_queue(policy: str) -> RequestQueue:
    """The waiting queue for ``--scheduling-policy``."""
    if policy == "priority":
        return PriorityQueue()
    if policy == "fcfs":
        return FCFSQueue()
    raise ValueError(f"scheduling policy must be 'fcfs' or 'priority', got {policy!r}")


def preemption_order_key(request):
    """Sort key: the request with the largest key is preempted first (lowest priority, latest
    arrival). Under FCFS every priority is equal, so it is the latest arrival."""
    return (request.priority, request.arrival_time)
