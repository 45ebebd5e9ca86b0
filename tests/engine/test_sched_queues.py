"""The scheduler's waiting queues on their own: first-come-first-served and by priority, what a
preempted request's requeue does in each, removal (an abort), and the preemption order."""

from __future__ import annotations

import pytest

from octavo.request import Request
from octavo.sched.request_queue import (
    FCFSQueue,
    PriorityQueue,
    make_queue,
    preemption_order_key,
)


def request(request_id: str, arrival_time: float, priority: int = 0) -> Request:
    return Request(request_id, [1, 2, 3], arrival_time=arrival_time, priority=priority)


def drain(queue) -> list[str]:
    """Pop every request, returning their ids in pop order."""
    popped = []
    while len(queue):
        popped.append(queue.pop().request_id)
    return popped


def ids(requests) -> list[str]:
    return [r.request_id for r in requests]


# --- first come, first served ---------------------------------------------------------------


def test_fcfs_pops_in_the_order_requests_were_added():
    """Arrival order is the order of ``add``; ``peek`` shows the next without taking it."""
    queue = FCFSQueue()
    for i, request_id in enumerate("ABC"):
        queue.add(request(request_id, float(i)))
    assert queue.peek().request_id == "A"
    assert len(queue) == 3 and ids(queue) == ["A", "B", "C"]
    assert drain(queue) == ["A", "B", "C"]


def test_fcfs_requeues_a_preempted_request_at_the_front():
    """A preempted request goes back ahead of everything still waiting, even earlier arrivals,
    so it is the next one admitted."""
    queue = FCFSQueue()
    queue.add(request("B", 1.0))
    queue.add(request("C", 2.0))
    queue.prepend(request("D", 3.0))  # preempted: it was running, so it resumes first
    queue.prepend(request("E", 4.0))  # preempted after D: the scheduler preempts latest first
    assert queue.peek().request_id == "E"
    assert drain(queue) == ["E", "D", "B", "C"]


def test_fcfs_remove_takes_out_one_request_and_keeps_the_others_in_order():
    queue = FCFSQueue()
    waiting = [request(request_id, float(i)) for i, request_id in enumerate("ABCD")]
    for r in waiting:
        queue.add(r)
    queue.remove(waiting[1])
    assert ids(queue) == ["A", "C", "D"]
    with pytest.raises(ValueError):
        queue.remove(waiting[1])  # not there any more
    assert drain(queue) == ["A", "C", "D"]


# --- by priority ----------------------------------------------------------------------------


def test_priority_pops_the_lowest_priority_value_first_then_the_earliest_arrival():
    """Whatever the order of ``add``: priority 0 before 5, and within a priority by arrival."""
    queue = PriorityQueue()
    for r in [
        request("late-urgent", 9.0, priority=0),
        request("early-lax", 1.0, priority=5),
        request("early-urgent", 2.0, priority=0),
        request("late-lax", 3.0, priority=5),
        request("most-urgent", 8.0, priority=-1),
    ]:
        queue.add(r)
    expected = ["most-urgent", "early-urgent", "late-urgent", "early-lax", "late-lax"]
    assert ids(queue) == expected  # iteration shows the pop order
    assert queue.peek().request_id == "most-urgent"
    assert drain(queue) == expected


def test_priority_ties_in_priority_and_arrival_keep_insertion_order():
    """Equal keys never compare the requests themselves: the insertion counter decides."""
    queue = PriorityQueue()
    for request_id in ["X", "Y", "Z"]:
        queue.add(request(request_id, 1.0, priority=2))
    assert drain(queue) == ["X", "Y", "Z"]


def test_priority_requeue_keeps_the_preempted_request_in_its_priority_place():
    """``prepend`` is not a jump to the front: a preempted request keeps its priority and
    arrival, so a more urgent waiting request still goes first, a later arrival after it."""
    queue = PriorityQueue()
    queue.add(request("urgent", 5.0, priority=0))
    queue.add(request("later", 6.0, priority=1))
    queue.prepend(request("preempted", 2.0, priority=1))
    assert drain(queue) == ["urgent", "preempted", "later"]


def test_priority_remove_takes_out_that_request_and_the_rest_stay_ordered():
    queue = PriorityQueue()
    waiting = [
        request("A", 1.0, priority=3),
        request("B", 2.0, priority=1),
        request("C", 3.0, priority=2),
        request("D", 4.0, priority=0),
    ]
    for r in waiting:
        queue.add(r)
    queue.remove(waiting[3])  # the head
    queue.remove(request("B", 2.0, priority=1))  # an equal-looking other object: not removed
    assert len(queue) == 3 and queue.peek().request_id == "B"
    queue.remove(waiting[1])
    assert drain(queue) == ["C", "A"]


# --- choosing a queue, and whom to preempt --------------------------------------------------


def test_make_queue_follows_the_scheduling_policy():
    assert isinstance(make_queue("fcfs"), FCFSQueue)
    assert isinstance(make_queue("priority"), PriorityQueue)
    with pytest.raises(ValueError, match="'fcfs' or 'priority'.*'lottery'"):
        make_queue("lottery")


def test_preemption_order_picks_the_largest_priority_value_then_the_latest_arrival():
    running = [
        request("A", 1.0, priority=0),
        request("B", 2.0, priority=7),
        request("C", 3.0, priority=7),
        request("D", 4.0, priority=1),
    ]
    assert max(running, key=preemption_order_key).request_id == "C"
    order = sorted(running, key=preemption_order_key, reverse=True)
    assert ids(order) == ["C", "B", "D", "A"]


def test_under_fcfs_priorities_the_latest_arrival_is_preempted_first():
    """FCFS leaves every priority at 0, so the key comes down to arrival time, whatever the
    order of the running list."""
    running = [request("B", 2.0), request("C", 3.0), request("A", 1.0)]
    assert max(running, key=preemption_order_key).request_id == "C"
    assert ids(sorted(running, key=preemption_order_key)) == ["A", "B", "C"]
