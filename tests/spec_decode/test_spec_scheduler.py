"""The scheduler's side of speculation, without a model: drafts ride with the new token within
the budget, the context and max_tokens; num_computed_tokens rolls back by the rejected ones;
drafts never reach the prefix cache and never outlive preemption."""

from __future__ import annotations

from octavo.config import SchedulerConfig
from octavo.kv_cache.manager import KVCacheManager
from octavo.request import Request
from octavo.sampling_params import SamplingParams
from octavo.sched.scheduler import Scheduler

BLOCK_SIZE = 4


def make_scheduler(num_blocks: int = 64, num_host_blocks: int = 0, **config) -> Scheduler:
    config.setdefault("max_model_len", 64)
    kv = KVCacheManager(num_blocks, BLOCK_SIZE, num_host_blocks=num_host_blocks)
    return Scheduler(SchedulerConfig(**config), kv)


def add(scheduler: Scheduler, request_id: str, prompt: list[int], **params) -> Request:
    request = Request(
        request_id,
        prompt,
        SamplingParams(temperature=0.0, **params),
        arrival_time=float(len(scheduler.requests)),
        block_hasher=scheduler.kv_cache_manager.block_hasher,
    )
    scheduler.add_request(request)
    return request


def prefill(scheduler: Scheduler, *requests: Request, drafts=(5, 6, 7)) -> None:
    """Compute the prompts, sample one token each, and propose ``drafts`` for each."""
    scheduler.schedule()
    scheduler.update_from_output(
        {r.request_id: [100] for r in requests}, {r.request_id: list(drafts) for r in requests}
    )


def test_drafts_are_scheduled_after_the_new_token_and_rolled_back_when_rejected():
    scheduler = make_scheduler()
    request = add(scheduler, "a", [1, 2, 3, 4, 5, 6])
    prefill(scheduler, request)
    assert request.num_computed_tokens == 6 and request.num_tokens == 7
    output = scheduler.schedule()
    assert output.num_scheduled_tokens == {"a": 4}
    assert output.scheduled_spec_token_ids == {"a": [5, 6, 7]}
    assert request.num_computed_tokens == 10  # the step computes the new token and 3 drafts
    # Draft 5 accepted, draft 6 rejected: the runner emits 5 and its own token 9.
    scheduler.update_from_output({"a": [5, 9]}, {"a": [8]})
    assert request.output_token_ids == [100, 5, 9]
    assert request.num_computed_tokens == 8  # KV of 100 and 5 stands; 6 and 7 are rejected
    assert request.spec_token_ids == [8]
    stats = scheduler.spec_stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 3, 1)
    assert stats.num_accepted_tokens_per_pos == [1]
    assert scheduler.schedule().num_scheduled_tokens == {"a": 2}


def test_drafts_are_trimmed_to_the_token_budget():
    scheduler = make_scheduler(max_num_batched_tokens=5)
    first, second = add(scheduler, "a", [1, 2]), add(scheduler, "b", [3, 4])
    prefill(scheduler, first, second)
    output = scheduler.schedule()
    assert output.num_scheduled_tokens == {"a": 4, "b": 1}
    assert output.scheduled_spec_token_ids == {"a": [5, 6, 7]}


def test_drafts_are_trimmed_to_the_context_and_to_max_tokens():
    scheduler = make_scheduler(max_model_len=10)
    near_end = add(scheduler, "a", [1] * 8)
    few_left = add(scheduler, "b", [2, 3], max_tokens=3)
    prefill(scheduler, near_end, few_left)
    output = scheduler.schedule()
    # a: 9 tokens of 10 -> one more position; b: 1 of 3 tokens out -> at most 2 emitted.
    assert output.scheduled_spec_token_ids == {"a": [5], "b": [5]}
    assert output.num_scheduled_tokens == {"a": 2, "b": 2}


def test_drafts_are_never_hashed_nor_published_to_the_prefix_cache():
    scheduler = make_scheduler()
    kv = scheduler.kv_cache_manager
    request = add(scheduler, "a", [1, 2, 3, 4, 5, 6])
    prefill(scheduler, request, drafts=(7, 8, 9, 10, 11))
    assert len(request.block_hashes) == 1  # [1..4]; the second block holds 5, 6, 100
    scheduler.schedule()  # positions 6..11: the second block fills with drafts
    assert len(request.block_hashes) == 1
    assert len(kv.block_pool.cached_blocks) == 1
    scheduler.update_from_output({"a": [12]})  # every draft rejected
    assert request.num_computed_tokens == 7
    # The second block now holds real tokens 5, 6, 100, 12: hashed, and published once the
    # step computing 12 is scheduled, under the hash of those tokens (not of the drafts).
    assert len(request.block_hashes) == 2 and len(kv.block_pool.cached_blocks) == 1
    real = Request("probe", [1, 2, 3, 4, 5, 6, 100, 12], block_hasher=kv.block_hasher)
    assert request.block_hashes == real.block_hashes
    scheduler.schedule()
    assert set(kv.block_pool.cached_blocks) == set(real.block_hashes)


def test_preemption_drops_the_drafts():
    scheduler = make_scheduler(num_blocks=4, max_model_len=16)
    first = add(scheduler, "a", [1, 2, 3, 4, 5, 6, 7])
    second = add(scheduler, "b", [8, 9, 10, 11, 12, 13, 14])
    prefill(scheduler, first, second)
    output = scheduler.schedule()  # both need a third block; only one is left -> b preempted
    assert set(output.num_scheduled_tokens) == {"a"}
    assert output.scheduled_spec_token_ids == {"a": [5, 6, 7]}
    assert second.spec_token_ids == [] and second.num_computed_tokens == 0


def test_swapped_out_requests_lose_their_drafts_too():
    scheduler = make_scheduler(
        num_blocks=4, num_host_blocks=8, max_model_len=16, preemption_mode="swap"
    )
    first = add(scheduler, "a", [1, 2, 3, 4, 5, 6, 7])
    second = add(scheduler, "b", [8, 9, 10, 11, 12, 13, 14])
    prefill(scheduler, first, second)
    scheduler.schedule()
    assert second in scheduler.swapped and second.spec_token_ids == []


def test_a_draft_model_gets_lookahead_slots_for_its_drafts():
    scheduler = make_scheduler(num_lookahead_tokens=3)
    request = add(scheduler, "a", [1, 2, 3, 4, 5])
    scheduler.schedule()
    # 5 prompt tokens + 3 lookahead slots: 8 slots, two blocks of 4
    assert scheduler.kv_cache_manager.get_num_blocks("a") == 2
    scheduler.update_from_output({"a": [6]}, {"a": [7, 8, 9]})
    scheduler.schedule()  # positions 5..8 computed, and lookahead to 11: three blocks
    assert scheduler.kv_cache_manager.get_num_blocks("a") == 3
    assert request.num_computed_tokens == 9
