"""The free queue and the block pool under the manager."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from octavo.kv_cache.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from octavo.kv_cache.hashing import BlockHash


def ids(queue):
    return [block.block_id for block in queue]


def test_free_queue_operations_keep_order_and_count():
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    assert ids(queue) == [0, 1, 2, 3, 4] and len(queue) == 5
    queue.remove(blocks[2])
    assert ids(queue) == [0, 1, 3, 4] and blocks[2].prev_free is None
    assert queue.popleft() is blocks[0]
    queue.append(blocks[0])
    queue.appendleft(blocks[2])
    assert ids(queue) == [2, 1, 3, 4, 0] and len(queue) == 5
    assert queue.popleft_n(2) == [blocks[2], blocks[1]] and ids(queue) == [3, 4, 0]
    assert len(queue) == 3 and blocks[1].next_free is None
    with pytest.raises(IndexError):
        queue.popleft_n(4)
    for _ in range(3):
        queue.popleft()
    with pytest.raises(IndexError):
        queue.popleft()


def test_free_queue_rejects_double_insertion():
    block = KVCacheBlock(0)
    queue = FreeBlockQueue([block])
    with pytest.raises(AssertionError):
        queue.append(block)


def test_pool_allocate_evicts_cached_blocks_and_counts():
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    pool.publish(a, BlockHash(b"a"))
    pool.publish(b, BlockHash(b"a"))  # hash already taken: b stays unpublished
    assert b.block_hash is None and pool.get_cached_block(BlockHash(b"a")) is a
    pool.free_blocks([a, b])
    assert [blk.block_id for blk in pool.free_queue] == [b.block_id, a.block_id]
    (first,) = pool.allocate(1)
    assert first is b and pool.num_evictions == 0
    (second,) = pool.allocate(1)
    assert second is a and pool.num_evictions == 1 and pool.cached_blocks == {}
    with pytest.raises(ValueError, match="only 0 are free"):
        pool.allocate(1)


def test_pool_touch_and_refcounts():
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    pool.publish(a, BlockHash(b"h"))
    pool.free_blocks([a])
    pool.touch([a, a])
    assert a.ref_cnt == 2 and pool.num_free_blocks == 1
    pool.free_blocks([a])
    assert pool.num_free_blocks == 1
    pool.free_blocks([a])
    assert pool.num_free_blocks == 2 and a.block_hash == b"h"


# A pool makes its blocks when the free queue first hands them out; one whose blocks are all made
# at once (``pool.blocks``) is the linked list of every block, the oracle.
POOL_OPS = st.lists(
    st.tuples(
        st.sampled_from(["allocate", "free", "publish", "touch", "reset"]), st.integers(0, 99)
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops=POOL_OPS, num_blocks=st.integers(1, 12))
def test_pool_with_blocks_made_on_first_use_behaves_as_one_made_at_once(ops, num_blocks):
    lazy, eager = BlockPool(num_blocks), BlockPool(num_blocks)
    eager.blocks  # every block made and linked now
    held: list[int] = []  # ids referenced once, in allocation order
    for op, n in ops:
        if op == "allocate":
            count = n % (lazy.num_free_blocks + 1)
            got = [pool.allocate(count) for pool in (lazy, eager)]
            assert [b.block_id for b in got[0]] == [b.block_id for b in got[1]]
            held += [b.block_id for b in got[0]]
        elif op in ("free", "publish") and held:
            block_id = held[n % len(held)]
            for pool in (lazy, eager):
                block = pool._blocks[block_id]  # made in id order
                if op == "free":
                    pool.free_blocks([block])
                else:
                    pool.publish(block, BlockHash(bytes([block_id, n])))
            if op == "free":
                held.remove(block_id)
        elif op == "touch" and lazy.cached_blocks:
            key = sorted(lazy.cached_blocks)[n % len(lazy.cached_blocks)]
            for pool in (lazy, eager):
                pool.touch([pool.cached_blocks[key]])
            held.append(lazy.cached_blocks[key].block_id)
        elif op == "reset":
            assert lazy.reset_prefix_cache() == eager.reset_prefix_cache()
        assert lazy.num_free_blocks == eager.num_free_blocks
        assert lazy.num_evictions == eager.num_evictions
    assert ids(lazy.free_queue) == ids(eager.free_queue)
    assert [b.ref_cnt for b in lazy.blocks] == [b.ref_cnt for b in eager.blocks]
    assert [b.block_id for b in lazy.blocks] == list(range(num_blocks))


def test_pool_makes_no_block_before_it_is_used():
    pool = BlockPool(65536)
    assert pool.num_free_blocks == 65536 and pool._blocks == []
    first = pool.allocate(2)
    pool.free_blocks(first)  # uncached: reused before the blocks never used
    assert [b.block_id for b in pool.allocate(3)] == [1, 0, 2] and len(pool._blocks) == 3
