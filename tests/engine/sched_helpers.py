"""Helpers for driving the scheduler without a model: a fake runner, requests, small caches."""

from __future__ import annotations

import itertools
from typing import Optional

from octavo.config import SchedulerConfig
from octavo.kv_cache.manager import KVCacheManager
from octavo.kv_cache.transfers import TransferKind
from octavo.request import Request
from octavo.sched.output import SchedulerOutput
from octavo.sched.scheduler import Scheduler

BLOCK_SIZE = 4

_prompt_token_ids = itertools.count(1)


def make_scheduler(
    num_blocks: int = 64,
    *,
    num_host_blocks: int = 0,
    enable_caching: bool = True,
    **config,
) -> Scheduler:
    """A scheduler over a real KV cache of ``num_blocks`` blocks of ``BLOCK_SIZE`` tokens."""
    kv = KVCacheManager(
        num_blocks, BLOCK_SIZE, enable_caching=enable_caching, num_host_blocks=num_host_blocks
    )
    return Scheduler(SchedulerConfig(**config), kv)


def make_request(
    scheduler: Scheduler,
    request_id: str,
    prompt: list[int] | int,
    *,
    arrival_time: Optional[float] = None,
    priority: int = 0,
) -> Request:
    """A request hashed for the scheduler's prefix cache; an int prompt means that many distinct
    tokens, unique to this request (so it shares no block with any other)."""
    if isinstance(prompt, int):
        prompt = [next(_prompt_token_ids) for _ in range(prompt)]
    return Request(
        request_id,
        prompt,
        arrival_time=arrival_time,
        priority=priority,
        block_hasher=scheduler.kv_cache_manager.block_hasher,
    )


def add_requests(scheduler: Scheduler, prompts: dict[str, list[int] | int], **kwargs) -> None:
    """Add requests in dict order, arriving at times 0, 1, 2, ..."""
    for arrival, (request_id, prompt) in enumerate(prompts.items()):
        request = make_request(scheduler, request_id, prompt, arrival_time=float(arrival), **kwargs)
        scheduler.add_request(request)


_token_ids = itertools.count(50_000)


def sample(scheduler: Scheduler) -> dict[str, list[int]]:
    """The fake runner's sampling after a step: one new token for every scheduled request whose
    tokens are all computed now (a partial prefill chunk samples nothing)."""
    return {
        request.request_id: [next(_token_ids)]
        for request in scheduler.running
        if request.num_computed_tokens == request.num_tokens
    }


def step(scheduler: Scheduler) -> SchedulerOutput:
    """One engine step without a model: schedule, then feed back what the runner would sample."""
    output = scheduler.schedule()
    scheduler.update_from_output(sample(scheduler))
    return output


def ids(requests) -> list[str]:
    return [request.request_id for request in requests]


def new_req(output: SchedulerOutput, request_id: str):
    """The step's NewRequestData for ``request_id`` (KeyError when it is not new)."""
    return {data.req_id: data for data in output.scheduled_new_reqs}[request_id]


def cached_req(output: SchedulerOutput, request_id: str):
    """The step's CachedRequestData for ``request_id`` (KeyError when it is not there)."""
    return {data.req_id: data for data in output.scheduled_cached_reqs}[request_id]


def transfers_of(output: SchedulerOutput, kind: TransferKind) -> list[tuple[tuple, tuple]]:
    """The step's block transfers of one kind, as ``(src, dst)`` pairs."""
    return [(t.src, t.dst) for t in output.kv_transfers if t.kind is kind]


def assert_all_blocks_free(scheduler: Scheduler) -> None:
    kv = scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.block_pool.num_blocks
    assert all(block.ref_cnt == 0 for block in kv.block_pool.blocks)
    assert kv.host_pool.num_free_blocks == kv.host_pool.num_blocks
