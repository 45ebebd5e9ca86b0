"""The free queue and the block pool under the manager."""

from __future__ import annotations

import pytest

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
