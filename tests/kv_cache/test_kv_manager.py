"""KVCacheManager, verb by verb, with a simulated worker holding real KV tensors."""

from __future__ import annotations

import pytest
import torch
from kv_sim import SimWorker, run_chunk

from octavo.errors import ConfigError
from octavo.kv_cache import (
    KVCacheManager,
    TransferKind,
    allocate_host_caches,
    apply_block_transfers,
)
from octavo.platform.types import AttentionBackend, AttentionSpec
from octavo.request import Request
from octavo.sampling_params import SamplingParams

BS = 4


def make(manager: KVCacheManager, request_id: str, tokens, **kwargs) -> Request:
    return Request(request_id, list(tokens), block_hasher=manager.block_hasher, **kwargs)


def prefill(manager: KVCacheManager, worker: SimWorker, request: Request) -> int:
    """Schedule the whole prompt after its cached prefix; returns the hit tokens."""
    hits, num_hit = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, request.num_tokens - num_hit, hits, num_hit) is not None
    request.num_computed_tokens = num_hit
    run_chunk(worker, request, request.num_tokens - num_hit)
    return num_hit


def decode(manager: KVCacheManager, worker: SimWorker, request: Request, token: int) -> None:
    request.append_output_token_ids(token)
    assert manager.allocate_slots(request, 1) is not None
    run_chunk(worker, request, 1)


@pytest.fixture
def manager() -> KVCacheManager:
    return KVCacheManager(16, BS, num_host_blocks=8)


@pytest.fixture
def worker(manager) -> SimWorker:
    return SimWorker(manager)


def test_shared_prefix_hits_and_reads_the_same_kv(manager, worker):
    a = make(manager, "a", range(10))
    assert prefill(manager, worker, a) == 0
    b = make(manager, "b", [*range(8), 50, 51, 52])
    assert prefill(manager, worker, b) == 8
    assert manager.get_block_ids("b")[:2] == manager.get_block_ids("a")[:2]
    assert (
        manager.get_block_ids("b", start=2) == manager.get_block_ids("b")[2:]
        and manager.get_num_blocks("b") == 3
    )
    worker.assert_holds(b)
    stats = manager.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (21, 8)


def test_whole_prompt_cached_still_recomputes_last_token(manager, worker):
    a = make(manager, "a", range(8))
    prefill(manager, worker, a)
    manager.free(a)
    again = make(manager, "again", range(8))
    hits, num_hit = manager.get_computed_blocks(again)
    assert num_hit == 4 and len(hits) == 1  # the block holding the last token is recomputed


def test_an_eagle_engine_recomputes_the_last_cached_block():
    """An EAGLE head's KV at a block's last position holds the token after it: a request that
    shares only the prefix recomputes that block rather than read another's."""
    manager = KVCacheManager(16, BS, recompute_last_cached_block=True)
    worker = SimWorker(manager)
    prefill(manager, worker, make(manager, "a", range(13)))
    b = make(manager, "b", [*range(12), 50])
    hits, num_hit = manager.get_computed_blocks(b)
    assert num_hit == 8 and len(hits) == 2  # of three cached blocks
    assert manager.get_computed_blocks(make(manager, "c", [0, 1, 2, 3, 9])) == ([], 0)


@pytest.mark.parametrize(
    "first, second",
    [
        ({"cache_salt": "tenant-a"}, {"cache_salt": "tenant-b"}),
        ({}, {"cache_salt": "x"}),
        ({"lora_id": 1}, {"lora_id": 2}),
        ({}, {"lora_id": 1}),
    ],
)
def test_different_salt_or_lora_never_hits(manager, worker, first, second):
    prefill(manager, worker, make(manager, "a", range(13), **first))
    assert manager.get_computed_blocks(make(manager, "b", range(13), **second)) == ([], 0)
    assert manager.get_computed_blocks(make(manager, "c", range(13), **first))[1] == 12


def test_prompt_logprobs_skip_the_cache(manager, worker):
    prefill(manager, worker, make(manager, "a", range(9)))
    b = make(manager, "b", range(9), sampling_params=SamplingParams(prompt_logprobs=1))
    assert manager.get_computed_blocks(b) == ([], 0)


def test_free_returns_blocks_immediately(manager, worker):
    a = make(manager, "a", range(10))
    prefill(manager, worker, a)
    assert manager.num_free_blocks == 13
    manager.free(a)
    assert manager.num_free_blocks == 16 and manager.usage == 0.0
    assert manager.get_block_ids("a") == []


def test_shared_block_freed_only_when_last_holder_frees(manager, worker):
    a = make(manager, "a", range(10))
    prefill(manager, worker, a)
    b = make(manager, "b", range(10))
    prefill(manager, worker, b)
    shared = manager.get_block_ids("a")[:2]
    manager.free(a)
    assert all(manager.block_pool.blocks[i].ref_cnt == 1 for i in shared)
    manager.free(b)
    assert manager.num_free_blocks == 16


def test_eviction_is_lru_with_chain_tails_first():
    manager = KVCacheManager(6, BS)
    worker = SimWorker(manager)
    a = make(manager, "a", range(100, 109))  # 2 full blocks + 1 partial
    b = make(manager, "b", range(200, 209))
    prefill(manager, worker, a)
    prefill(manager, worker, b)
    a_ids, b_ids = manager.get_block_ids("a"), manager.get_block_ids("b")
    manager.free(a)  # a first: least recently used
    manager.free(b)
    order = [block.block_id for block in manager.block_pool.free_queue]
    # uncached partial blocks are reused first, then a's chain tail, a's root, b's tail, b's root
    assert order == [b_ids[2], a_ids[2], a_ids[1], a_ids[0], b_ids[1], b_ids[0]]
    c = make(manager, "c", range(300, 312))
    assert manager.allocate_slots(c, 12) is not None
    assert manager.get_block_ids("c") == [b_ids[2], a_ids[2], a_ids[1]]
    assert manager.stats().num_evictions == 1
    # a's root survived the eviction of its tail, but a lookup stops at the missing block 1
    assert manager.get_computed_blocks(make(manager, "a2", range(100, 109)))[1] == 4
    assert manager.get_computed_blocks(make(manager, "b2", range(200, 209)))[1] == 8


def test_prefix_hit_touch_removes_block_from_free_queue(manager, worker):
    a = make(manager, "a", range(9))
    prefill(manager, worker, a)
    manager.free(a)
    b = make(manager, "b", range(9))
    prefill(manager, worker, b)
    free_ids = {block.block_id for block in manager.block_pool.free_queue}
    assert not free_ids & set(manager.get_block_ids("b"))


def test_allocate_returns_none_and_changes_nothing_when_full():
    manager = KVCacheManager(4, BS)
    a = make(manager, "a", range(12))
    assert len(manager.allocate_slots(a, 12)) == 3
    b = make(manager, "b", range(50, 58))
    assert manager.allocate_slots(b, 8) is None
    assert manager.get_block_ids("b") == [] and manager.num_free_blocks == 1
    assert manager.allocate_slots(b, 4) is not None


def test_allocation_that_needs_its_own_hit_blocks_does_not_evict_them():
    manager = KVCacheManager(3, BS)
    worker = SimWorker(manager)
    a = make(manager, "a", range(9))
    prefill(manager, worker, a)
    manager.free(a)  # 2 cached blocks and 1 uncached, all free
    b = make(manager, "b", [*range(8), 70, 71, 72, 73])
    hits, num_hit = manager.get_computed_blocks(b)
    assert num_hit == 8
    assert manager.allocate_slots(b, 4, hits, num_hit) is not None
    c = make(manager, "c", [*range(8), 70, 71, 72, 73, 74])
    hits, num_hit = manager.get_computed_blocks(c)
    assert manager.allocate_slots(c, 5, hits, num_hit) is None  # would need a 4th block


def test_lookahead_slots_are_allocated_but_not_published(manager, worker):
    a = make(manager, "a", range(6))
    assert len(manager.allocate_slots(a, 6, num_lookahead_tokens=3)) == 3
    assert len(manager.block_pool.cached_blocks) == 1
    assert manager.request_waste("a") == 6


def test_fork_and_copy_on_write_leave_the_parent_untouched(manager, worker):
    parent = make(manager, "p", range(10))
    prefill(manager, worker, parent)
    child = parent.fork("c")
    manager.fork(parent, child)
    assert manager.get_block_ids("c") == manager.get_block_ids("p")
    assert all(manager.block_pool.blocks[i].ref_cnt == 2 for i in manager.get_block_ids("p"))
    child.append_output_token_ids(77)
    assert manager.allocate_slots(child, 1) == []  # room in the last block, but it is shared
    pending = manager.take_pending_copies()
    last = manager.get_block_ids("p")[-1]
    assert pending.transfers[0].kind is TransferKind.COPY and pending.transfers[0].src == (last,)
    (update,) = pending.block_table_updates
    assert (update.request_id, update.block_index) == ("c", 2) and update.block_id != last
    apply_block_transfers(
        worker.backend, worker.device_caches, worker.host_caches, pending.transfers
    )
    run_chunk(worker, child, 1)
    decode(manager, worker, parent, 88)  # the parent now owns its block alone: no copy
    assert not manager.take_pending_copies()
    worker.assert_holds(parent)
    worker.assert_holds(child)
    assert parent.all_token_ids[10] == 88 and child.all_token_ids[10] == 77
    assert manager.get_block_ids("c")[:2] == manager.get_block_ids("p")[:2]


def test_fork_of_full_blocks_needs_no_copy(manager, worker):
    parent = make(manager, "p", range(8))
    prefill(manager, worker, parent)
    child = parent.fork("c")
    manager.fork(parent, child)
    decode(manager, worker, child, 5)
    decode(manager, worker, parent, 6)
    assert manager.get_block_ids("c")[:2] == manager.get_block_ids("p")[:2]
    worker.assert_holds(parent)
    worker.assert_holds(child)


def test_fork_errors(manager, worker):
    a = make(manager, "a", range(5))
    with pytest.raises(ValueError, match="holds no KV blocks"):
        manager.fork(a, a.fork("b"))
    prefill(manager, worker, a)
    stale = make(manager, "s", range(5))
    with pytest.raises(ValueError, match="parent.fork"):
        manager.fork(a, stale)


def test_swap_out_then_swap_in_restores_contents(manager, worker):
    a = make(manager, "a", range(10))
    prefill(manager, worker, a)
    decode(manager, worker, a, 42)  # 11 tokens computed
    device_block_ids = manager.get_block_ids("a")
    mapping = manager.swap_out(a)
    assert [d for d, _ in mapping] == device_block_ids and manager.get_block_ids("a") == []
    assert manager.get_host_block_ids("a") == [h for _, h in mapping]
    worker.apply_pending()
    worker.assert_host_holds(a)
    # reuse the device blocks for someone else, and drop the cache so nothing can be reused
    other = make(manager, "o", range(500, 560))
    prefill(manager, worker, other)
    manager.reset_prefix_cache()
    assert manager.swap_in(a) is None  # does not fit while `other` runs
    manager.free(other)
    mapping = manager.swap_in(a)
    assert len(mapping) == 3 and manager.host_pool.num_free_blocks == 8
    worker.apply_pending()
    worker.assert_holds(a)
    decode(manager, worker, a, 43)
    worker.assert_holds(a)


def test_swap_in_reuses_blocks_still_cached(manager, worker):
    a = make(manager, "a", range(10))
    prefill(manager, worker, a)
    manager.swap_out(a)
    mapping = manager.swap_in(a)
    assert len(mapping) == 1  # two full blocks were still in the prefix cache
    worker.apply_pending()
    worker.assert_holds(a)


def test_swap_out_fails_cleanly_without_host_space(worker):
    manager = KVCacheManager(16, BS, num_host_blocks=2)
    a = make(manager, "a", range(10))
    manager.allocate_slots(a, 10)
    a.num_computed_tokens = 10
    assert manager.swap_out(a) is None
    assert len(manager.get_block_ids("a")) == 3 and manager.host_pool.num_free_blocks == 2


def test_free_of_swapped_request_releases_host_blocks(manager, worker):
    a = make(manager, "a", range(10))
    prefill(manager, worker, a)
    manager.swap_out(a)
    manager.free(a)
    assert manager.host_pool.num_free_blocks == 8 and manager.num_free_blocks == 16


def test_copies_planned_in_one_step_apply_in_planning_order(manager, worker):
    """Swap out, copy-on-write and swap in within one step, reusing each other's blocks."""
    a = make(manager, "a", range(10))
    prefill(manager, worker, a)
    b = make(manager, "b", range(100, 106))
    prefill(manager, worker, b)
    c = b.fork("c")
    manager.fork(b, c)
    manager.swap_out(a)
    manager.reset_prefix_cache()
    worker.apply_pending()
    # one step: a swaps in (taking blocks), c copies-on-write, b swaps out (freeing blocks),
    # then a block b freed is reused by the next swap in of b: every transfer reads what was
    # there when it was planned.
    assert manager.swap_in(a) is not None
    c.append_output_token_ids(9)
    assert manager.allocate_slots(c, 1) is not None
    assert manager.swap_out(b) is not None
    manager.free(c)
    assert manager.swap_in(b) is not None
    transfers = manager.take_pending_copies().transfers
    kinds = [t.kind for t in transfers]
    assert kinds == [
        TransferKind.SWAP_IN,
        TransferKind.COPY,
        TransferKind.SWAP_OUT,
        TransferKind.SWAP_IN,
    ]
    assert set(transfers[2].dst) & set(transfers[0].src), "host blocks are reused within the step"
    assert set(transfers[3].dst) & set(transfers[1].dst), (
        "a copy-on-write block is reused within the step"
    )
    apply_block_transfers(worker.backend, worker.device_caches, worker.host_caches, transfers)
    worker.assert_holds(a)
    worker.assert_holds(b)


def test_blocks_published_for_uncomputed_tokens_are_withdrawn_on_free(manager, worker):
    a = make(manager, "a", range(10))
    assert manager.allocate_slots(a, 10) is not None  # scheduled, then preempted before running
    assert len(manager.block_pool.cached_blocks) == 2
    manager.free(a)
    assert manager.block_pool.cached_blocks == {}
    assert manager.get_computed_blocks(make(manager, "b", range(10))) == ([], 0)


def test_caching_disabled_never_publishes():
    manager = KVCacheManager(8, BS, enable_caching=False)
    worker = SimWorker(manager)
    prefill(manager, worker, make(manager, "a", range(10)))
    assert manager.block_pool.cached_blocks == {}
    assert manager.get_computed_blocks(make(manager, "b", range(10))) == ([], 0)


def test_stats_report_usage_fragmentation_and_waste(manager, worker):
    a = make(manager, "a", range(10))
    prefill(manager, worker, a)
    b = make(manager, "b", range(10))
    prefill(manager, worker, b)
    stats = manager.stats()
    assert stats.num_free_blocks == 12 and stats.usage == pytest.approx(0.25)
    assert stats.num_allocated_slots == 16 and stats.num_used_slots == 12
    assert stats.fragmentation == 4 and stats.fragmentation_ratio == pytest.approx(0.25)
    assert stats.max_request_waste == 2 and manager.request_waste("a") == 2
    assert stats.prefix_cache_hit_rate == pytest.approx(8 / 20)


def test_invalid_construction():
    with pytest.raises(ConfigError, match="at least one block"):
        KVCacheManager(0, BS)
    with pytest.raises(ConfigError, match="sha256, fast"):
        KVCacheManager(4, BS, hash_algo="md5")


def test_swap_round_trip_restores_float_kv_bit_for_bit():
    """Random K/V in the default layout, two layers: swap out, clobber the device, swap in."""
    manager = KVCacheManager(8, BS, enable_caching=False, num_host_blocks=4)
    spec = AttentionSpec(
        num_heads=4, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16, block_size=BS, scale=1.0
    )
    backend = AttentionBackend(spec)
    generator = torch.Generator().manual_seed(0)
    device = [
        torch.randn(backend.kv_cache_shape(8), generator=generator).to(torch.bfloat16)
        for _ in range(2)
    ]
    host = allocate_host_caches(backend, 2, 4, torch.bfloat16)
    assert device[0].shape == (2, 8, BS, 2, 8) and host[0].shape == (2, 4, BS, 2, 8)
    a = make(manager, "a", range(10))
    manager.allocate_slots(a, 10)
    a.num_computed_tokens = 10
    before = [cache[:, manager.get_block_ids("a")].clone() for cache in device]
    manager.swap_out(a)
    apply_block_transfers(backend, device, host, manager.take_pending_copies().transfers)
    for cache in device:
        cache.fill_(float("nan"))
    filler = make(manager, "f", range(4))
    manager.allocate_slots(filler, 4)  # the swapped-in copy lands on other blocks
    manager.swap_in(a)
    apply_block_transfers(backend, device, host, manager.take_pending_copies().transfers)
    for cache, expected in zip(device, before):
        assert torch.equal(cache[:, manager.get_block_ids("a")], expected)
