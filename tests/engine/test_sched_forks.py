"""ChildForks on its own: which children wait, the cap on the first child, forking with room,
release when the first child ends or a prefix hit covers it, and discarding a waiting child."""

from __future__ import annotations

from octavo.kv_cache.manager import KVCacheManager
from octavo.request import Request, RequestStatus
from octavo.sched.forks import ChildForks

BLOCK_SIZE = 4
PROMPT = list(range(1, 11))  # 10 tokens: the first child computes 9 before the fork


def family(forks: ChildForks, kv: KVCacheManager, num_children: int = 3) -> list[Request]:
    children = [
        Request(f"{i}_p", PROMPT, block_hasher=kv.block_hasher) for i in range(num_children)
    ]
    queued = [forks.add(child, "p") for child in children]
    assert queued == [True] + [False] * (num_children - 1)
    return children


def compute_prompt_but_last(kv: KVCacheManager, first: Request) -> None:
    """What the scheduler and a step do for the first child: 9 tokens computed, running."""
    assert kv.allocate_slots(first, 9) is not None
    first.num_computed_tokens = 9
    first.status = RequestStatus.RUNNING


def setup(num_children: int = 3):
    kv = KVCacheManager(32, BLOCK_SIZE, enable_caching=True)
    forks = ChildForks(kv)
    return kv, forks, family(forks, kv, num_children)


def test_only_the_first_child_is_queued_and_the_others_wait():
    _, forks, (first, *others) = setup()
    assert first not in forks and all(child in forks for child in others)
    assert forks.num_waiting == 2


def test_a_one_token_prompt_has_nothing_to_share():
    kv = KVCacheManager(32, BLOCK_SIZE)
    forks = ChildForks(kv)
    assert forks.add(Request("0_q", [7]), "q") and forks.add(Request("1_q", [7]), "q")
    assert forks.num_waiting == 0


def test_the_first_child_is_capped_at_its_prompt_but_the_last_token():
    _, forks, (first, *_) = setup()
    assert forks.cap(first, 100) == 9
    first.num_computed_tokens = 4
    assert forks.cap(first, 100) == 5 and forks.cap(first, 3) == 3
    assert forks.cap(Request("other", PROMPT), 100) == 100  # not a first child: no cap


def test_the_others_fork_the_first_childs_blocks_as_room_allows():
    kv, forks, (first, second, third) = setup()
    compute_prompt_but_last(kv, first)
    forks.fork_ready(room=1)
    assert forks.take_forked() == [second] and forks.take_released() == [third]
    assert second.status == RequestStatus.RUNNING and second.num_computed_tokens == 9
    assert kv.get_block_ids(second.request_id) == kv.get_block_ids(first.request_id)
    assert forks.num_waiting == 0 and forks.take_forked() == []  # taken once


def test_nothing_forks_before_the_prompt_is_computed():
    kv, forks, (first, *_) = setup()
    first.status = RequestStatus.RUNNING
    forks.fork_ready(room=8)
    assert forks.take_forked() == [] and forks.num_waiting == 2


def test_a_prefix_hit_covering_the_prompt_releases_the_others():
    _, forks, (first, *others) = setup()
    assert forks.cap(first, 100, num_computed=9) == 100  # nothing left to compute before a fork
    assert forks.take_released() == others and forks.num_waiting == 0


def test_the_others_run_alone_when_the_first_child_ends_before_the_fork():
    _, forks, (first, *others) = setup()
    forks.first_child_finished(first)
    assert forks.take_released() == others and forks.num_waiting == 0
    forks.first_child_finished(first)  # twice: nothing more
    assert forks.take_released() == []


def test_a_discarded_child_is_neither_forked_nor_released():
    kv, forks, (first, second, third) = setup()
    forks.discard(third)
    assert third not in forks and forks.num_waiting == 1
    compute_prompt_but_last(kv, first)
    forks.fork_ready(room=8)
    assert forks.take_forked() == [second] and forks.take_released() == []
