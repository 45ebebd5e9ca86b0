"""BatchDeltaBuilder on its own, over a real KV cache manager: what the workers are told each
step. ``Steps`` plays the scheduler and the runner: it allocates slots, builds the step's
output, advances ``num_computed_tokens`` and appends a sampled token to every request whose
tokens are all computed. Blocks hold ``BLOCK_SIZE`` = 4 tokens."""

from __future__ import annotations

import itertools

import pytest
from sched_helpers import BLOCK_SIZE, cached_req, new_req, transfers_of

from octavo.kv_cache.manager import KVCacheManager
from octavo.kv_cache.transfers import TransferKind
from octavo.request import Request
from octavo.sched.batch_delta import BatchDeltaBuilder
from octavo.sched.output import SchedulerOutput


class Steps:
    """A KV cache, a BatchDeltaBuilder over it, and the scheduler's side of each step."""

    def __init__(self, num_blocks: int = 32, num_host_blocks: int = 0) -> None:
        self.kv = KVCacheManager(num_blocks, BLOCK_SIZE, num_host_blocks=num_host_blocks)
        self.deltas = BatchDeltaBuilder(self.kv)
        self._tokens = itertools.count(1000)

    def request(self, request_id: str, num_prompt_tokens: int) -> Request:
        prompt = [next(self._tokens) for _ in range(num_prompt_tokens)]
        return Request(request_id, prompt, block_hasher=self.kv.block_hasher)

    def step(self, scheduled: dict[Request, int]) -> SchedulerOutput:
        """Schedule ``num_new_tokens`` for each request, build, then play the runner."""
        for request, num_new in scheduled.items():
            assert self.kv.allocate_slots(request, num_new) is not None
        output = self.deltas.build(list(scheduled), {r.request_id: n for r, n in scheduled.items()})
        for request, num_new in scheduled.items():
            request.num_computed_tokens += num_new
            if request.num_computed_tokens == request.num_tokens:
                request.append_output_token_ids(next(self._tokens))
        return output

    def decode(self, request: Request) -> SchedulerOutput:
        """A decode step of ``request`` alone (its one newest token)."""
        return self.step({request: request.num_tokens - request.num_computed_tokens})

    def recompute_preempt(self, request: Request) -> None:
        """The scheduler's recompute preemption: the blocks go, the request starts over."""
        self.kv.free(request)
        request.num_computed_tokens = 0
        self.deltas.preempted(request.request_id)


def only_cached(output: SchedulerOutput, request_id: str):
    """The request's CachedRequestData, checking it is not also sent as new."""
    assert request_id not in {data.req_id for data in output.scheduled_new_reqs}
    return cached_req(output, request_id)


def test_a_new_request_is_sent_in_full_once():
    """First step: NewRequestData with the prompt and the whole block table. Later steps of the
    same request are CachedRequestData, and a step that adds no block sends no block id."""
    steps = Steps()
    a = steps.request("A", 6)
    first = steps.step({a: 6})
    data = new_req(first, "A")
    assert data.prompt_token_ids == a.prompt_token_ids
    assert data.block_ids == steps.kv.get_block_ids("A") and len(data.block_ids) == 2
    assert data.num_computed_tokens == 0 and data.output_token_ids == []
    assert first.scheduled_cached_reqs == []
    assert first.num_scheduled_tokens == {"A": 6} and first.total_num_scheduled_tokens == 6

    second = steps.decode(a)  # token 7 lands in the second block: no new block
    delta = only_cached(second, "A")
    assert delta.new_block_ids == [] and delta.num_computed_tokens == 6
    assert delta.block_table_start is None and not delta.resumed_from_preemption


def test_cached_requests_get_only_the_block_ids_added_since_the_last_step():
    """A prefill in chunks and a decode crossing a block boundary: each step names just the
    blocks appended to the table, which add up to the manager's table."""
    steps = Steps()
    a = steps.request("A", 10)
    sent = list(new_req(steps.step({a: 4}), "A").block_ids)
    assert len(sent) == 1
    chunk = only_cached(steps.step({a: 6}), "A")  # tokens 4..9: blocks 1 and 2
    assert len(chunk.new_block_ids) == 2 and chunk.num_computed_tokens == 4
    sent += chunk.new_block_ids
    for _ in range(2):  # tokens 10 and 11 fill block 2
        assert only_cached(steps.decode(a), "A").new_block_ids == []
    crossing = only_cached(steps.decode(a), "A")  # token 12 opens block 3
    assert len(crossing.new_block_ids) == 1 and crossing.block_table_start is None
    sent += crossing.new_block_ids
    assert sent == steps.kv.get_block_ids("A")


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_request_back_from_preemption_gets_its_whole_new_table(mode):
    """After preemption the workers' table is stale: the request comes back as CachedRequestData
    flagged resumed, with every block id from 0, once; the step after is a plain delta."""
    steps = Steps(num_host_blocks=8)
    a = steps.request("A", 6)
    steps.step({a: 6})
    if mode == "swap":
        assert steps.kv.swap_out(a) is not None
        steps.deltas.preempted("A")
        steps.kv.take_pending_copies()  # the swap-out went with an (idle) step
        assert steps.kv.swap_in(a) is not None
        resumed_output = steps.decode(a)
    else:
        steps.recompute_preempt(a)
        resumed_output = steps.step({a: a.num_tokens})  # prompt and output token again

    resumed = only_cached(resumed_output, "A")
    assert resumed.resumed_from_preemption and resumed.block_table_start == 0
    assert resumed.new_block_ids == steps.kv.get_block_ids("A") and len(resumed.new_block_ids) == 2
    assert resumed.num_computed_tokens == (0 if mode == "recompute" else 6)
    after = only_cached(steps.decode(a), "A")
    assert not after.resumed_from_preemption and after.block_table_start is None


def test_preempting_a_request_the_workers_never_saw_leaves_it_new():
    """Nothing to restart: it is sent new, and the step after is a plain delta, not a resume."""
    steps = Steps()
    a = steps.request("A", 5)
    steps.deltas.preempted("A")
    output = steps.step({a: 5})
    assert new_req(output, "A").block_ids == steps.kv.get_block_ids("A")
    assert output.scheduled_cached_reqs == []
    after = only_cached(steps.decode(a), "A")
    assert not after.resumed_from_preemption and after.block_table_start is None


def test_finished_requests_are_reported_once_and_only_if_the_workers_saw_them():
    steps = Steps()
    a, b = steps.request("A", 3), steps.request("B", 3)
    steps.step({a: 3})
    steps.kv.free(a)
    steps.deltas.finish("A")
    steps.deltas.finish("B")  # finished (say, aborted) before it was ever scheduled
    assert steps.step({b: 3}).finished_req_ids == {"A"}
    assert steps.decode(b).finished_req_ids == set()


def test_after_forget_all_every_request_is_sent_in_full_again():
    """The workers dropped their batch (a failed step): each request, when next scheduled, is a
    NewRequestData again, with its tokens so far; a preemption noted before is moot."""
    steps = Steps()
    a, b = steps.request("A", 6), steps.request("B", 2)
    steps.step({a: 6, b: 2})
    steps.decode(a)
    steps.recompute_preempt(a)
    steps.deltas.forget_all()
    steps.recompute_preempt(b)  # the scheduler requeues everything from scratch

    generated = list(a.output_token_ids)
    assert len(generated) == 2
    output = steps.step({a: a.num_tokens, b: b.num_tokens})
    assert output.scheduled_cached_reqs == []
    again = new_req(output, "A")
    assert again.output_token_ids == generated and again.num_computed_tokens == 0
    assert again.prompt_token_ids == a.prompt_token_ids
    assert again.block_ids == steps.kv.get_block_ids("A")
    assert new_req(output, "B").block_ids == steps.kv.get_block_ids("B")
    later = only_cached(steps.decode(a), "A")  # and deltas after that: token 8 opens block 2
    assert later.new_block_ids == steps.kv.get_block_ids("A")[2:] and len(later.new_block_ids) == 1
    assert later.block_table_start is None and not later.resumed_from_preemption


def test_a_forgotten_request_that_finishes_before_being_resent_is_still_reported():
    """The workers may keep something of a dropped request (its generator), so finishing it is
    reported even though it was not sent since ``forget_all``; once, and never after a resend."""
    steps = Steps()
    a, b = steps.request("A", 4), steps.request("B", 4)
    steps.step({a: 4, b: 4})
    steps.deltas.forget_all()
    steps.kv.free(a)
    steps.deltas.finish("A")
    steps.recompute_preempt(b)
    output = steps.step({b: b.num_tokens})
    assert output.finished_req_ids == {"A"}
    assert new_req(output, "B").req_id == "B"
    assert steps.decode(b).finished_req_ids == set()


def test_copy_on_write_rewrites_the_table_from_the_copied_block():
    """A fork shares the parent's partly filled last block; the parent's next token is written
    into a copy, so its delta cuts the table at that block and names the copy, with the copy in
    the step's transfers. The child is new to the workers: it gets the shared table in full."""
    steps = Steps()
    parent = steps.request("P", 6)
    shared = new_req(steps.step({parent: 6}), "P").block_ids  # 2 blocks, the last one half full
    child = parent.fork("C")
    steps.kv.fork(parent, child)

    output = steps.step({parent: 1, child: 1})
    delta = only_cached(output, "P")
    copy = steps.kv.get_block_ids("P")[1]
    assert copy != shared[1] and steps.kv.get_block_ids("P")[0] == shared[0]
    assert delta.block_table_start == 1 and delta.new_block_ids == [copy]
    assert not delta.resumed_from_preemption
    assert transfers_of(output, TransferKind.COPY) == [((shared[1],), (copy,))]
    assert new_req(output, "C").block_ids == shared  # the child writes in place: sole owner now
    assert steps.kv.get_block_ids("C") == shared

    after = only_cached(steps.decode(parent), "P")
    assert after.block_table_start is None and after.new_block_ids == []
