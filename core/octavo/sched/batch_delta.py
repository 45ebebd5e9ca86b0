"""What the workers must be told each step: full data for requests they have not seen, deltas
for the rest (new block ids, block-table rewrites after copy-on-write or preemption), the KV
copies to perform first, and the requests that finished."""

from __future__ import annotations

from octavo.kv_cache.manager import KVCacheManager
from octavo.request import Request
from octavo.sched.output import (
    CachedRequestData,
    NewRequestData,
    SchedulerOutput,
)


class BatchDeltaBuilder:
    """Remembers, per request, how much of its block table the workers already hold."""

    def __init__(self, kv_cache_manager: KVCacheManager):
        self.kv_cache_manager = kv_cache_manager
        self._num_sent_blocks: dict[str, int] = {}
        self._resumed: set[str] = set()
        self._finished: set[str] = set()
        self._forgotten: set[str] = (
            set()
        )  # dropped by the workers after a failed step, not sent since

    def preempted(self, request_id: str) -> None:
        """The request lost (or swapped out) its blocks: its table restarts when it resumes."""
        if request_id in self._num_sent_blocks:
            self._resumed.add(request_id)

    def finish(self, request_id: str) -> None:
        if self._num_sent_blocks.pop(request_id, None) is not None or request_id in self._forgotten:
            self._finished.add(request_id)  # the workers may keep something of it (a generator)
        self._resumed.discard(request_id)
        self._forgotten.discard(request_id)

    def forget_all(self) -> None:
        """The workers dropped every request (a step failed part-way, see ModelRunner): each is
        sent again in full when next scheduled."""
        self._forgotten.update(self._num_sent_blocks)
        self._num_sent_blocks.clear()
        self._resumed.clear()

    def build(
        self, scheduled: list[Request], num_scheduled_tokens: dict[str, int]
    ) -> SchedulerOutput:
        """The step's SchedulerOutput; call before advancing ``num_computed_tokens``."""
        kv = self.kv_cache_manager
        pending = kv.take_pending_copies()
        rewritten: dict[str, int] = {}
        for update in pending.block_table_updates:
            rewritten[update.request_id] = min(
                update.block_index, rewritten.get(update.request_id, update.block_index)
            )
        new_reqs, cached_reqs = [], []
        for request in scheduled:
            request_id = request.request_id
            num_blocks = kv.get_num_blocks(request_id)
            num_sent = self._num_sent_blocks.get(request_id)
            self._num_sent_blocks[request_id] = num_blocks
            if num_sent is None:
                self._forgotten.discard(request_id)
                new_reqs.append(
                    NewRequestData(
                        request_id,
                        request.prompt_token_ids,
                        request.sampling_params,
                        kv.get_block_ids(request_id),
                        request.num_computed_tokens,
                        list(request.output_token_ids),
                        request.lora_request,
                    )
                )
                continue
            resumed = request_id in self._resumed
            start = 0 if resumed else min(num_sent, rewritten.get(request_id, num_sent))
            if resumed:
                self._resumed.discard(request_id)
            cached_reqs.append(
                CachedRequestData(
                    request_id,
                    kv.get_block_ids(request_id, start) if start < num_blocks else [],
                    request.num_computed_tokens,
                    resumed_from_preemption=resumed,
                    block_table_start=start if (resumed or start != num_sent) else None,
                )
            )
        finished, self._finished = self._finished, set()
        return SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=num_scheduled_tokens,
            total_num_scheduled_tokens=sum(num_scheduled_tokens.values()),
            finished_req_ids=finished,
            kv_transfers=pending.transfers,
        )
