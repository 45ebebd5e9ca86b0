"""The scheduler: one rule for prefill, chunked prefill, prefix hits and decode.

Each step every scheduled request gets enough new tokens for ``num_computed_tokens`` to catch up
with its tokens, within the step's token budget and ``max_num_seqs``: running requests first,
then swapped-out ones, then waiting ones. When ``allocate_slots`` says no, the lowest-priority
running request (the latest arrival under FCFS) is preempted and the allocation retried.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Optional

from octavo.config import SchedulerConfig
from octavo.kv_cache.manager import KVCacheManager
from octavo.request import Request, RequestStatus
from octavo.sched.batch_delta import BatchDeltaBuilder
from octavo.sched.forks import ChildForks
from octavo.sched.output import SchedulerOutput
from octavo.sched.request_queue import make_queue, preemption_order_key


@dataclasses.dataclass(slots=True)
class SchedulerStats:
    """Counts for the metrics layer, updated every step."""

    num_running: int = 0
    num_waiting: int = 0
    num_swapped: int = 0
    num_scheduled_tokens: int = 0
    num_preempted_total: int = 0
    num_swapped_out_total: int = 0
    num_steps: int = 0


@dataclasses.dataclass(slots=True)
class _StepPlan:
    """What one ``schedule()`` call has decided so far."""

    token_budget: int
    num_scheduled_tokens: dict[str, int] = dataclasses.field(default_factory=dict)
    scheduled: list[Request] = dataclasses.field(default_factory=list)
    num_preempted: int = 0


class Scheduler:
    """Decides, each step, which requests compute how many tokens (DESIGN §2)."""

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager):
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.requests: dict[str, Request] = {}
        self.waiting = make_queue(config.scheduling_policy)
        self.swapped: list[Request] = []
        self.running: list[Request] = []
        self.forks = ChildForks(kv_cache_manager)
        self.deltas = BatchDeltaBuilder(kv_cache_manager)
        self.stats = SchedulerStats()

    # --- requests in and out ----------------------------------------------------------------

    def add_request(self, request: Request, parent_id: Optional[str] = None) -> None:
        """Queue a request. The children of one ``parent_id`` (the n samples of one user
        request) share the prompt's KV blocks: the first computes it, the others fork from it."""
        if request.request_id in self.requests:
            raise ValueError(
                f"request id {request.request_id!r} is already in use; use a unique id"
            )
        self.requests[request.request_id] = request
        if parent_id is None or self.forks.add(request, parent_id):
            self.waiting.add(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """End requests (stopped, length, aborted) and free their blocks at once."""
        for request_id in request_ids:
            request = self.requests.pop(request_id, None)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif request.status == RequestStatus.SWAPPED:
                self.swapped.remove(request)
            elif request in self.forks:
                self.forks.discard(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self.kv_cache_manager.free(request)
            self.deltas.finish(request_id)
            self.forks.first_child_finished(request)
            self._settle_forks()  # a released child may be the next id to finish

    def _settle_forks(self) -> None:
        """Forked children join the running requests and released ones the waiting queue at
        once, so that between steps every request is in exactly one place (an abort finds it)."""
        self.running.extend(self.forks.take_forked())
        for request in self.forks.take_released():
            self.waiting.add(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # --- one step ---------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Plan one step: which requests compute how many tokens, and the KV copies before it."""
        plan = _StepPlan(token_budget=self.config.max_num_batched_tokens)
        self._schedule_running(plan)
        if plan.num_preempted == 0:
            self._schedule_swapped(plan)
            self._schedule_waiting(plan)
        self._settle_forks()  # a prefix hit may have released children waiting to fork
        output = self.deltas.build(plan.scheduled, plan.num_scheduled_tokens)
        for request in plan.scheduled:
            request.num_computed_tokens += plan.num_scheduled_tokens[request.request_id]
        self._update_stats(plan)
        return output

    def _num_new_tokens(self, request: Request, token_budget: int) -> int:
        num_new = request.num_tokens - request.num_computed_tokens
        return self.forks.cap(request, min(num_new, token_budget))

    def _schedule_running(self, plan: _StepPlan) -> None:
        for request in list(self.running):
            if plan.token_budget <= 0:
                return
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this pass
            num_new = self._num_new_tokens(request, plan.token_budget)
            if num_new > 0 and self._allocate_or_preempt(request, num_new, plan):
                self._admit(request, num_new, plan)

    def _allocate_or_preempt(self, request: Request, num_new: int, plan: _StepPlan) -> bool:
        while self.kv_cache_manager.allocate_slots(request, num_new) is None:
            victim = max(self.running, key=preemption_order_key)
            self._preempt(victim, plan)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request, plan: _StepPlan) -> None:
        self.running.remove(request)
        if request.request_id in plan.num_scheduled_tokens:
            plan.token_budget += plan.num_scheduled_tokens.pop(request.request_id)
            plan.scheduled.remove(request)
        plan.num_preempted += 1
        self.stats.num_preempted_total += 1
        if (
            self.config.preemption_mode == "swap"
            and self.kv_cache_manager.swap_out(request) is not None
        ):
            request.status = RequestStatus.SWAPPED
            self.swapped.append(request)
            self.stats.num_swapped_out_total += 1
        else:
            self.kv_cache_manager.free(request)
            request.num_computed_tokens = 0
            request.status = RequestStatus.PREEMPTED
            self.waiting.prepend(request)
        self.deltas.preempted(request.request_id)

    def _schedule_swapped(self, plan: _StepPlan) -> None:
        while (
            self.swapped and len(self.running) < self.config.max_num_seqs and plan.token_budget > 0
        ):
            request = self.swapped[0]
            if self.kv_cache_manager.swap_in(request) is None:
                return
            self.swapped.pop(0)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            num_new = self._num_new_tokens(request, plan.token_budget)
            if num_new > 0 and self.kv_cache_manager.allocate_slots(request, num_new) is not None:
                self._admit(request, num_new, plan)

    def _schedule_waiting(self, plan: _StepPlan) -> None:
        kv = self.kv_cache_manager
        while (
            len(self.waiting)
            and plan.token_budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            request = self.waiting.peek()
            computed_blocks, num_cached = kv.get_computed_blocks(request)
            num_new = request.num_tokens - num_cached
            if not self.config.enable_chunked_prefill and num_new > plan.token_budget:
                return
            num_new = self.forks.cap(request, min(num_new, plan.token_budget), num_cached)
            if kv.allocate_slots(request, num_new, computed_blocks, num_cached) is None:
                return
            self.waiting.pop()
            request.num_computed_tokens = num_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._admit(request, num_new, plan)

    def _admit(self, request: Request, num_new: int, plan: _StepPlan) -> None:
        plan.num_scheduled_tokens[request.request_id] = num_new
        plan.scheduled.append(request)
        plan.token_budget -= num_new

    def _update_stats(self, plan: _StepPlan) -> None:
        stats = self.stats
        stats.num_running = len(self.running)
        stats.num_waiting = len(self.waiting) + self.forks.num_waiting
        stats.num_swapped = len(self.swapped)
        stats.num_scheduled_tokens = sum(plan.num_scheduled_tokens.values())
        stats.num_steps += 1

    def restart_after_failed_step(self) -> None:
        """Undo a step that failed before its forward pass: every request holding KV blocks is
        preempted to be recomputed (lossless: it keeps its output tokens, and the runner its
        generator), the workers, which dropped every request, get each again in full, and the
        prefix cache forgets blocks the step may have published without computing them."""
        for request in reversed(self.running + self.swapped):
            self.kv_cache_manager.free(request)
            request.num_computed_tokens = 0
            request.status = RequestStatus.PREEMPTED
            self.waiting.prepend(request)
            self.stats.num_preempted_total += 1
        self.running.clear()
        self.swapped.clear()
        self.deltas.forget_all()
        self.kv_cache_manager.reset_prefix_cache()

    # --- after the step ---------------------------------------------------------------------

    def update_from_output(self, sampled_token_ids: dict[str, list[int]]) -> None:
        """Append each request's sampled tokens (the runner appended them to its own copy)."""
        requests = self.requests
        for request_id, token_ids in sampled_token_ids.items():
            request = requests.get(request_id)
            if request is not None and token_ids:
                request.append_output_token_ids(token_ids)
        self.forks.fork_ready(room=self.config.max_num_seqs - len(self.running))
        self._settle_forks()
