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
from octavo.spec_decode.policy import SpeculationPolicy
from octavo.spec_decode.stats import SpecDecodeStats


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
    spec_token_ids: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    num_preempted: int = 0


class Scheduler:
    """Decides, each step, which requests compute how many tokens (DESIGN §2)."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        spec_policy: Optional[SpeculationPolicy] = None,
    ):
        """``spec_policy`` decides which drafts are worth scheduling (None: every one)."""
        self.config = config
        self.spec_policy = spec_policy
        self.kv_cache_manager = kv_cache_manager
        self.requests: dict[str, Request] = {}
        self.waiting = make_queue(config.scheduling_policy)
        self.swapped: list[Request] = []
        self.running: list[Request] = []
        self.forks = ChildForks(kv_cache_manager)
        self.deltas = BatchDeltaBuilder(kv_cache_manager)
        self.stats = SchedulerStats()
        self.spec_stats = SpecDecodeStats()
        self._num_scheduled_drafts: dict[str, int] = {}  # of the step in flight

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
        if self.spec_policy is not None:
            self.spec_policy.start_step(len(self.running))
        self._schedule_running(plan)
        if plan.num_preempted == 0:
            self._schedule_swapped(plan)
            self._schedule_waiting(plan)
        self._settle_forks()  # a prefix hit may have released children waiting to fork
        output = self.deltas.build(plan.scheduled, plan.num_scheduled_tokens)
        output.scheduled_spec_token_ids = plan.spec_token_ids
        if self.spec_policy is not None:
            output.propose_drafts = self.spec_policy.propose_after(len(self.running))
        self._num_scheduled_drafts = {r: len(d) for r, d in plan.spec_token_ids.items()}
        for request in plan.scheduled:
            request.num_computed_tokens += plan.num_scheduled_tokens[request.request_id]
            request.spec_token_ids = []  # sent, or trimmed away: the proposer drafts afresh
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
            drafts = self._drafts(request, num_new, plan.token_budget)
            num_new += len(drafts)
            if num_new > 0 and self._allocate_or_preempt(request, num_new, plan):
                self._admit(request, num_new, plan)
                if drafts:
                    plan.spec_token_ids[request.request_id] = drafts

    def _drafts(self, request: Request, num_new: int, token_budget: int) -> list[int]:
        """The request's drafts this step: only when its one new token is scheduled, trimmed to
        the token budget, the context (``max_model_len``) and what ``max_tokens`` leaves."""
        drafts = request.spec_token_ids
        if not drafts or num_new != 1 or request.num_tokens - request.num_computed_tokens != 1:
            return []
        if self.spec_policy is not None and not self.spec_policy.allows(request):
            return []
        k = min(len(drafts), token_budget - 1)
        if self.config.max_model_len is not None:
            k = min(k, self.config.max_model_len - request.num_tokens)
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:
            k = min(k, max_tokens - request.num_output_tokens - 1)
        return drafts[: max(k, 0)]

    def _lookahead(self, num_computed: int, num_new: int) -> int:
        """KV slots past the scheduled tokens for a draft model's drafts, within the context."""
        lookahead, max_model_len = self.config.num_lookahead_tokens, self.config.max_model_len
        if not lookahead or max_model_len is None:
            return lookahead
        return max(0, min(lookahead, max_model_len - num_computed - num_new))

    def _allocate_or_preempt(self, request: Request, num_new: int, plan: _StepPlan) -> bool:
        lookahead = self._lookahead(request.num_computed_tokens, num_new)
        while self.kv_cache_manager.allocate_slots(request, num_new, (), 0, lookahead) is None:
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
            plan.spec_token_ids.pop(request.request_id, None)
        request.spec_token_ids = []  # drafts never outlive the KV they were drafted on
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
        loras = _LoRAAdmission(self.config.max_loras, self.running)
        while (
            self.swapped and len(self.running) < self.config.max_num_seqs and plan.token_budget > 0
        ):
            request = self.swapped[0]
            if not loras.admits(request):  # resumes once a running adapter's requests end
                return
            if self.kv_cache_manager.swap_in(request) is None:
                return
            loras.admitted(request)
            self.swapped.pop(0)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            num_new = self._num_new_tokens(request, plan.token_budget)
            lookahead = self._lookahead(request.num_computed_tokens, num_new)
            if (
                num_new > 0
                and self.kv_cache_manager.allocate_slots(request, num_new, (), 0, lookahead)
                is not None
            ):
                self._admit(request, num_new, plan)

    def _schedule_waiting(self, plan: _StepPlan) -> None:
        kv = self.kv_cache_manager
        loras = _LoRAAdmission(self.config.max_loras, self.running)
        while (
            len(self.waiting)
            and plan.token_budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            request = self.waiting.peek()
            if not loras.admits(request):  # its adapter would not fit: the others go first
                loras.set_aside(self.waiting.pop())
                continue
            computed_blocks, num_cached = kv.get_computed_blocks(request)
            num_new = request.num_tokens - num_cached
            if not self.config.enable_chunked_prefill and num_new > plan.token_budget:
                break
            num_new = self.forks.cap(request, min(num_new, plan.token_budget), num_cached)
            lookahead = self._lookahead(num_cached, num_new)
            if kv.allocate_slots(request, num_new, computed_blocks, num_cached, lookahead) is None:
                break
            self.waiting.pop()
            request.num_computed_tokens = num_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            loras.admitted(request)
            self._admit(request, num_new, plan)
        loras.put_back(self.waiting)

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
            request.spec_token_ids = []
            request.status = RequestStatus.PREEMPTED
            self.waiting.prepend(request)
            self.stats.num_preempted_total += 1
        self.running.clear()
        self.swapped.clear()
        self.deltas.forget_all()
        self.kv_cache_manager.reset_prefix_cache()

    # --- after the step ---------------------------------------------------------------------

    def update_from_output(
        self,
        sampled_token_ids: dict[str, list[int]],
        spec_token_ids: Optional[dict[str, list[int]]] = None,
    ) -> None:
        """Append each request's sampled tokens (the runner appended them to its own copy). A
        request that verified ``k`` drafts got its accepted ones and one more token: its
        ``num_computed_tokens`` rolls back by the rejected ``k + 1 - len(tokens)``, whose KV was
        computed for tokens it does not have. ``spec_token_ids`` are the next step's drafts."""
        requests = self.requests
        num_drafts = self._num_scheduled_drafts
        for request_id, token_ids in sampled_token_ids.items():
            request = requests.get(request_id)
            if request is None or not token_ids:
                continue
            k = num_drafts.get(request_id, 0)
            if k:
                num_rejected = k + 1 - len(token_ids)
                request.num_computed_tokens -= num_rejected
                self.kv_cache_manager.release_unused_slots(request, num_rejected)
                self.spec_stats.observe(k, k - num_rejected)
            request.append_output_token_ids(token_ids)
        self._num_scheduled_drafts = {}
        for request_id, drafts in (spec_token_ids or {}).items():
            request = requests.get(request_id)
            if request is not None and request.status == RequestStatus.RUNNING:
                request.spec_token_ids = drafts
        self.forks.fork_ready(room=self.config.max_num_seqs - len(self.running))
        self._settle_forks()


class _LoRAAdmission:
    """Keeps the running requests within ``max_loras`` distinct LoRA adapters (0: LoRA is off,
    everything is admitted): a request of a new adapter waits while the slots are taken, set
    aside so that the requests behind it (the base model's, or a running adapter's) go on."""

    __slots__ = ("max_loras", "active", "aside")

    def __init__(self, max_loras: int, running: list[Request]):
        self.max_loras = max_loras
        self.active = {r.lora_id for r in running if r.lora_id} if max_loras else set()
        self.aside: list[Request] = []

    def admits(self, request: Request) -> bool:
        lora_id = request.lora_id
        return (
            not self.max_loras
            or not lora_id
            or lora_id in self.active
            or len(self.active) < self.max_loras
        )

    def admitted(self, request: Request) -> None:
        if self.max_loras and request.lora_id:
            self.active.add(request.lora_id)

    def set_aside(self, request: Request) -> None:
        self.aside.append(request)

    def put_back(self, waiting) -> None:
        """The set-aside requests back at the head of ``waiting``, in their order."""
        for request in reversed(self.aside):
            waiting.prepend(request)
