"""The scheduler on its own: a real KV cache manager, no model, no runner.

``sched_helpers.step`` plays the runner: after ``schedule()`` it samples one token for every
request whose tokens are all computed (a partial prefill chunk samples nothing). Blocks hold
``BLOCK_SIZE`` = 4 tokens; an int prompt is that many tokens no other request shares.
"""

from __future__ import annotations

from sched_helpers import (
    BLOCK_SIZE,
    add_requests,
    assert_all_blocks_free,
    cached_req,
    ids,
    make_request,
    make_scheduler,
    new_req,
    sample,
    step,
    transfers_of,
)

from octavo.kv_cache.transfers import TransferKind
from octavo.request import RequestStatus

STOPPED = RequestStatus.FINISHED_STOPPED


# --- token budget and max_num_seqs ----------------------------------------------------------


def test_running_requests_are_served_before_waiting_ones_within_the_budget():
    """Running requests get all the tokens they need first; a waiting request gets what is left
    of max_num_batched_tokens, and the step's total is exactly the budget."""
    scheduler = make_scheduler(max_num_batched_tokens=10)
    add_requests(scheduler, {"A": 6, "B": 6})
    first = step(scheduler)
    assert first.num_scheduled_tokens == {"A": 6, "B": 4}
    assert first.total_num_scheduled_tokens == 10

    scheduler.add_request(make_request(scheduler, "C", 8, arrival_time=5.0))
    second = step(scheduler)
    assert list(second.num_scheduled_tokens.items()) == [("A", 1), ("B", 2), ("C", 7)]
    assert second.total_num_scheduled_tokens == 10

    third = step(scheduler)
    assert third.num_scheduled_tokens == {"A": 1, "B": 1, "C": 1}


def test_no_step_exceeds_max_num_batched_tokens():
    """Over a whole mixed workload every step stays within the budget, and every prompt and
    output token is scheduled exactly once (no preemption: blocks are plentiful)."""
    budget = 7
    scheduler = make_scheduler(max_num_batched_tokens=budget)
    prompts = {f"r{i}": 3 + 5 * i for i in range(6)}
    add_requests(scheduler, prompts)
    total = 0
    for _ in range(30):
        output = step(scheduler)
        assert 0 < output.total_num_scheduled_tokens <= budget
        assert output.total_num_scheduled_tokens == sum(output.num_scheduled_tokens.values())
        total += output.total_num_scheduled_tokens
    requests = scheduler.running
    assert ids(requests) == list(prompts) and all(r.output_token_ids for r in requests)
    for request in requests:  # its prompt and every output token but the newest, once each
        assert request.num_computed_tokens == request.num_tokens - 1
    assert total == sum(r.num_tokens - 1 for r in requests)
    assert scheduler.stats.num_preempted_total == 0


def test_max_num_seqs_caps_the_running_set():
    """With max_num_seqs=2 a third request waits, whatever the budget, until one ends."""
    scheduler = make_scheduler(max_num_seqs=2)
    add_requests(scheduler, {"A": 3, "B": 3, "C": 3})
    for _ in range(3):
        output = step(scheduler)
        assert sorted(output.num_scheduled_tokens) == ["A", "B"]
        assert ids(scheduler.running) == ["A", "B"] and ids(scheduler.waiting) == ["C"]
    scheduler.finish_requests(["A"], STOPPED)
    output = step(scheduler)
    assert output.num_scheduled_tokens == {"B": 1, "C": 3}
    assert output.finished_req_ids == {"A"}


# --- chunked prefill -------------------------------------------------------------------------


def test_chunked_prefill_splits_a_long_prompt_exactly():
    """A 10-token prompt under a 4-token budget computes 4 + 4 + 2 tokens; nothing is sampled
    until the last chunk, and each chunk continues where the previous one stopped."""
    scheduler = make_scheduler(max_num_batched_tokens=4)
    request = make_request(scheduler, "long", 10)
    scheduler.add_request(request)
    chunks, computed_before = [], []
    for _ in range(3):
        assert request.output_token_ids == []
        output = step(scheduler)
        chunks.append(output.num_scheduled_tokens["long"])
        data = output.scheduled_new_reqs or output.scheduled_cached_reqs
        computed_before.append(data[0].num_computed_tokens)
    assert chunks == [4, 4, 2] and sum(chunks) == request.num_prompt_tokens
    assert computed_before == [0, 4, 8]
    assert len(request.output_token_ids) == 1
    assert step(scheduler).num_scheduled_tokens == {"long": 1}
    assert len(request.output_token_ids) == 2
    assert scheduler.kv_cache_manager.get_num_blocks("long") == 3  # 12 tokens' worth of slots


def test_without_chunked_prefill_a_prompt_larger_than_the_remaining_budget_waits():
    """With chunked prefill off, a prompt that does not fit in what is left of the budget is not
    split: it waits (and, FCFS, so does everything behind it) until a step has room."""
    scheduler = make_scheduler(max_num_batched_tokens=8, enable_chunked_prefill=False)
    add_requests(scheduler, {"A": 6, "B": 6, "C": 1})
    first = step(scheduler)
    assert first.num_scheduled_tokens == {"A": 6}
    assert ids(scheduler.waiting) == ["B", "C"]
    second = step(scheduler)
    assert second.num_scheduled_tokens == {"A": 1, "B": 6, "C": 1}


# --- prefix caching --------------------------------------------------------------------------


def test_prefix_hit_starts_at_the_cached_full_blocks():
    """A second prompt sharing two full blocks with a computed one starts with 8 tokens
    computed, on the very same blocks, and computes only its own tail."""
    scheduler = make_scheduler()
    kv = scheduler.kv_cache_manager
    shared = list(range(1, 9))
    scheduler.add_request(make_request(scheduler, "A", shared + [90, 91]))
    first = step(scheduler)
    a_blocks = new_req(first, "A").block_ids
    scheduler.add_request(make_request(scheduler, "B", shared + [70, 71, 72]))
    second = step(scheduler)
    b = new_req(second, "B")
    assert b.num_computed_tokens == 2 * BLOCK_SIZE
    assert b.block_ids[:2] == a_blocks[:2] and b.block_ids[2] not in a_blocks
    assert second.num_scheduled_tokens == {"A": 1, "B": 3}
    assert kv.prefix_cache_hits == 8
    assert [kv.block_pool.blocks[i].ref_cnt for i in a_blocks[:2]] == [2, 2]


def test_prefix_hit_never_covers_the_last_prompt_token():
    """A prompt identical to a cached 8-token prompt (two full blocks) reuses only the first
    block: the block holding its last token is recomputed so that it gets logits."""
    scheduler = make_scheduler()
    prompt = list(range(1, 9))
    scheduler.add_request(make_request(scheduler, "A", prompt))
    step(scheduler)
    scheduler.add_request(make_request(scheduler, "B", prompt))
    b = new_req(step(scheduler), "B")
    assert b.num_computed_tokens == BLOCK_SIZE
    assert scheduler.requests["B"].num_computed_tokens == len(prompt)


# --- preemption ------------------------------------------------------------------------------


def fill_five_blocks(**config):
    """Three 4-token prompts in a 5-block cache, after one step: each holds one block and has
    sampled a token, so each needs a second block for its next step and only two are free."""
    scheduler = make_scheduler(5, **config)
    add_requests(scheduler, {"A": 4, "B": 4, "C": 4})
    assert step(scheduler).num_scheduled_tokens == {"A": 4, "B": 4, "C": 4}
    assert scheduler.kv_cache_manager.num_free_blocks == 2
    return scheduler


def test_fcfs_preempts_the_latest_arrival_and_requeues_it_at_the_front():
    """Out of blocks, the latest arrival is preempted (recompute): it loses its blocks and its
    progress, keeps its output, goes to the front of waiting, and resumes on a fresh table."""
    scheduler = fill_five_blocks(enable_caching=False)
    scheduler.add_request(make_request(scheduler, "D", 8, arrival_time=10.0))
    c = scheduler.requests["C"]
    output = step(scheduler)
    assert output.num_scheduled_tokens == {"A": 1, "B": 1}  # nothing admitted after preempting
    assert c.status == RequestStatus.PREEMPTED and c.num_computed_tokens == 0
    assert len(c.output_token_ids) == 1 and c.num_tokens == 5
    assert scheduler.kv_cache_manager.get_num_blocks("C") == 0
    assert scheduler.stats.num_preempted_total == 1
    assert ids(scheduler.waiting) == ["C", "D"]
    assert step(scheduler).num_scheduled_tokens == {"A": 1, "B": 1}  # C needs 2 blocks, 1 free
    scheduler.finish_requests(["A"], STOPPED)
    resumed = step(scheduler)
    assert resumed.num_scheduled_tokens == {"B": 1, "C": 5}  # D (2 blocks) does not fit after C
    c_data = cached_req(resumed, "C")
    assert c_data.resumed_from_preemption and c_data.block_table_start == 0
    assert c_data.num_computed_tokens == 0
    assert c_data.new_block_ids == scheduler.kv_cache_manager.get_block_ids("C")
    assert len(c_data.new_block_ids) == 2
    assert ids(scheduler.waiting) == ["D"]


def test_priority_policy_preempts_the_largest_priority_value_first():
    """Under "priority" the victim is the request with the largest priority value, even when it
    is the earliest arrival and first in the running list (FCFS would take C, the latest)."""
    scheduler = make_scheduler(5, scheduling_policy="priority", enable_caching=False)
    scheduler.add_request(make_request(scheduler, "B", 4, arrival_time=0.0, priority=5))
    step(scheduler)
    scheduler.add_request(make_request(scheduler, "A", 4, arrival_time=1.0, priority=0))
    scheduler.add_request(make_request(scheduler, "C", 4, arrival_time=2.0, priority=1))
    assert step(scheduler).num_scheduled_tokens == {"B": 1, "A": 4, "C": 4}
    assert ids(scheduler.running) == ["B", "A", "C"]
    output = step(scheduler)
    assert output.num_scheduled_tokens == {"A": 1, "C": 1}
    b = scheduler.requests["B"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert ids(scheduler.running) == ["A", "C"] and ids(scheduler.waiting) == ["B"]


def test_preempted_request_refunds_its_scheduled_tokens_to_the_budget():
    """A request preempted after it was scheduled in the same pass gives its tokens back: the
    chunked prefill after it gets 5 of the 6-token budget, not 4."""
    scheduler = make_scheduler(4, scheduling_policy="priority", max_num_batched_tokens=6)
    scheduler.add_request(make_request(scheduler, "B", 4, arrival_time=0.0, priority=5))
    step(scheduler)
    scheduler.add_request(make_request(scheduler, "A", 4, arrival_time=1.0, priority=0))
    scheduler.add_request(make_request(scheduler, "C", 20, arrival_time=2.0, priority=1))
    assert step(scheduler).num_scheduled_tokens == {"B": 1, "A": 4, "C": 1}
    assert scheduler.kv_cache_manager.num_free_blocks == 0
    output = step(scheduler)  # B is scheduled (1 token), then preempted for A's new block
    assert output.num_scheduled_tokens == {"A": 1, "C": 5}
    assert output.total_num_scheduled_tokens == 6
    assert scheduler.requests["B"].status == RequestStatus.PREEMPTED
    assert "B" not in {data.req_id for data in output.scheduled_cached_reqs}


# --- swap ------------------------------------------------------------------------------------


def test_swap_mode_swaps_out_then_back_in_before_waiting_requests():
    """With host blocks, the victim is swapped out (its computed KV copied to host, its progress
    kept) and, once blocks free up, swapped back in ahead of a waiting request."""
    scheduler = fill_five_blocks(preemption_mode="swap", num_host_blocks=8, enable_caching=False)
    kv = scheduler.kv_cache_manager
    c = scheduler.requests["C"]
    (c_block,) = kv.get_block_ids("C")
    out = step(scheduler)
    assert out.num_scheduled_tokens == {"A": 1, "B": 1}
    assert c.status == RequestStatus.SWAPPED and ids(scheduler.swapped) == ["C"]
    assert c.num_computed_tokens == 4
    assert transfers_of(out, TransferKind.SWAP_OUT) == [((c_block,), (0,))]
    assert kv.get_host_block_ids("C") == [0] and kv.get_num_blocks("C") == 0
    assert scheduler.stats.num_swapped_out_total == 1

    scheduler.finish_requests(["A"], STOPPED)  # 3 blocks free: C needs 2, D needs 2
    scheduler.add_request(make_request(scheduler, "D", 8, arrival_time=10.0))
    back = step(scheduler)
    assert back.num_scheduled_tokens == {"B": 1, "C": 1}
    assert ids(scheduler.waiting) == ["D"]
    (swap_in,) = transfers_of(back, TransferKind.SWAP_IN)
    assert swap_in[0] == (0,) and swap_in[1] == (kv.get_block_ids("C")[0],)
    c_data = cached_req(back, "C")
    assert c_data.resumed_from_preemption and c_data.block_table_start == 0
    assert c_data.num_computed_tokens == 4 and c_data.new_block_ids == kv.get_block_ids("C")
    assert c.status == RequestStatus.RUNNING and kv.host_pool.num_free_blocks == 8


def test_swap_mode_falls_back_to_recompute_when_host_blocks_run_out():
    """A victim whose computed blocks do not fit in the free host blocks is recomputed instead."""
    scheduler = make_scheduler(5, preemption_mode="swap", num_host_blocks=1, enable_caching=False)
    add_requests(scheduler, {"A": 4, "B": 4, "C": 8})
    step(scheduler)
    c = scheduler.requests["C"]
    out = step(scheduler)
    assert out.num_scheduled_tokens == {"A": 1, "B": 1}
    assert c.status == RequestStatus.PREEMPTED and c.num_computed_tokens == 0
    assert ids(scheduler.waiting) == ["C"] and scheduler.swapped == []
    assert transfers_of(out, TransferKind.SWAP_OUT) == []
    assert scheduler.kv_cache_manager.host_pool.num_free_blocks == 1
    assert (scheduler.stats.num_preempted_total, scheduler.stats.num_swapped_out_total) == (1, 0)


# --- finishing -------------------------------------------------------------------------------


def test_finish_requests_frees_every_block_and_reports_what_the_runner_knew():
    """Finishing running, swapped and waiting requests frees every device and host block; the
    next step tells the runner to drop those it was sent (not the never-scheduled one)."""
    scheduler = fill_five_blocks(preemption_mode="swap", num_host_blocks=8)
    step(scheduler)  # C is swapped out
    scheduler.add_request(make_request(scheduler, "D", 4, arrival_time=10.0))
    assert ids(scheduler.swapped) == ["C"] and ids(scheduler.waiting) == ["D"]
    scheduler.finish_requests(["A", "B", "C", "D"], RequestStatus.FINISHED_ABORTED)
    assert_all_blocks_free(scheduler)
    assert not scheduler.has_unfinished_requests()
    output = scheduler.schedule()
    assert output.finished_req_ids == {"A", "B", "C"}
    assert output.total_num_scheduled_tokens == 0
    assert scheduler.schedule().finished_req_ids == set()


# --- n > 1 -----------------------------------------------------------------------------------


def test_children_wait_for_the_first_child_then_share_its_blocks():
    """The other children of a parent wait while the first child computes its prompt but the last
    token; then they join with its progress and blocks, and every sample computes the last
    token itself (the shared partial block copied on write for all but the last writer)."""
    scheduler = make_scheduler()
    kv = scheduler.kv_cache_manager
    prompt = list(range(1, 11))
    for name in ("L", "S1", "S2"):
        scheduler.add_request(make_request(scheduler, name, prompt), parent_id="g")
    first = scheduler.schedule()
    assert first.num_scheduled_tokens == {"L": 9}
    assert ids(scheduler.waiting) == [] and scheduler.stats.num_waiting == 2
    first_blocks = kv.get_block_ids("L")
    assert sample(scheduler) == {}
    scheduler.update_from_output({})

    second = step(scheduler)
    assert second.num_scheduled_tokens == {"L": 1, "S1": 1, "S2": 1}
    for name in ("S1", "S2"):
        data = new_req(second, name)
        assert data.num_computed_tokens == 9 and data.block_ids[:2] == first_blocks[:2]
    assert [kv.block_pool.blocks[i].ref_cnt for i in first_blocks[:2]] == [3, 3]
    (copy,) = transfers_of(second, TransferKind.COPY)
    assert copy[0] == (first_blocks[2], first_blocks[2])
    assert kv.get_block_ids("S2")[2] == first_blocks[2]  # the last writer keeps the original
    l_data = cached_req(second, "L")
    assert l_data.block_table_start == 2 and l_data.new_block_ids == [kv.get_block_ids("L")[2]]
    assert kv.num_free_blocks == kv.block_pool.num_blocks - 5
    assert all(len(scheduler.requests[n].output_token_ids) == 1 for n in ("L", "S1", "S2"))


def test_children_are_released_when_the_prefix_cache_covers_the_first_child():
    """When a prefix hit already covers the first child's prompt but the last token, there is
    nothing to wait for: the other children are queued and hit the same cached blocks."""
    scheduler = make_scheduler()
    prompt = list(range(1, 10))  # 9 tokens: two full blocks and the last token
    scheduler.add_request(make_request(scheduler, "warm", prompt))
    step(scheduler)
    for name in ("L", "S1"):
        scheduler.add_request(make_request(scheduler, name, prompt), parent_id="g")
    second = step(scheduler)
    assert second.num_scheduled_tokens == {"warm": 1, "L": 1}
    assert new_req(second, "L").num_computed_tokens == 8
    third = step(scheduler)
    assert third.num_scheduled_tokens == {"warm": 1, "L": 1, "S1": 1}
    assert new_req(third, "S1").num_computed_tokens == 8


# --- restart after a failed step -------------------------------------------------------------


def test_restart_after_failed_step_requeues_every_request_from_scratch():
    """After a failed step every running and swapped request waits again with nothing computed
    and its output kept; all blocks are free and the prefix cache is empty; the runner is told
    dropped every request it knew (it does so itself), and each is sent again in full with its
    output tokens."""
    scheduler = fill_five_blocks(preemption_mode="swap", num_host_blocks=8)
    kv = scheduler.kv_cache_manager
    scheduler.add_request(make_request(scheduler, "D", 4, arrival_time=10.0))
    failed = scheduler.schedule()  # C is swapped out; then the step fails in the runner
    assert failed.num_scheduled_tokens == {"A": 1, "B": 1} and ids(scheduler.swapped) == ["C"]
    outputs = {name: list(scheduler.requests[name].output_token_ids) for name in "ABC"}
    scheduler.restart_after_failed_step()

    assert scheduler.running == [] and scheduler.swapped == []
    assert ids(scheduler.waiting) == ["A", "B", "C", "D"]
    for name in "ABC":
        request = scheduler.requests[name]
        assert request.status == RequestStatus.PREEMPTED and request.num_computed_tokens == 0
        assert request.output_token_ids == outputs[name] and len(outputs[name]) == 1
    assert_all_blocks_free(scheduler)
    assert len(kv.block_pool.cached_blocks) == 0

    again = step(scheduler)
    assert again.finished_req_ids == set()
    assert again.num_scheduled_tokens == {"A": 5, "B": 5}  # 2 blocks each; C needs 2, 1 free
    for name in "AB":
        data = new_req(again, name)
        assert data.num_computed_tokens == 0 and data.output_token_ids == outputs[name]
    assert again.scheduled_cached_reqs == []
    scheduler.finish_requests(["A"], RequestStatus.FINISHED_ABORTED)
    later = step(scheduler)
    assert later.finished_req_ids == {"A"}
    assert new_req(later, "C").output_token_ids == outputs["C"]
    assert new_req(later, "C").num_computed_tokens == 0
