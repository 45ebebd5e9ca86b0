"""Physical KV blocks: refcounts, the LRU free queue, and the block-hash -> block map."""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, Iterator, Optional

from octavo.kv_cache.hashing import BlockHash


@dataclasses.dataclass(slots=True, eq=False)
class KVCacheBlock:
    """One physical block. ``prev_free``/``next_free`` link it into the free queue (None when not
    in it); ``block_hash`` is set while the block is published in the prefix cache."""

    block_id: int
    ref_cnt: int = 0
    block_hash: Optional[BlockHash] = None
    prev_free: Optional["KVCacheBlock"] = None
    next_free: Optional["KVCacheBlock"] = None

    def __repr__(self) -> str:
        cached = "" if self.block_hash is None else f", hash={self.block_hash[:4].hex()}"
        return f"KVCacheBlock({self.block_id}, ref_cnt={self.ref_cnt}{cached})"


class FreeBlockQueue:
    """Blocks with refcount 0, as an intrusive doubly linked list in eviction order.

    The head is taken first. Every operation is O(1): the links live in the blocks themselves,
    so a block found by a prefix hit leaves the middle of the queue without a search.

    ``num_fresh`` blocks that were never used (ids ``0 .. num_fresh - 1``) can stand in the queue,
    after ``blocks``, as one node (a cache of 65,536 blocks took ~0.3 s of start-up to make and
    link as objects): each is made by ``make_block(block_id)``, in id order, when the head
    reaches it. Blocks put at the head later go before them, blocks put at the tail after them,
    as if they had been linked one by one.
    """

    __slots__ = ("_head", "_tail", "_fresh", "_next_fresh", "_make_block", "num_free_blocks")

    def __init__(
        self,
        blocks: Iterable[KVCacheBlock] = (),
        *,
        num_fresh: int = 0,
        make_block: Callable[[int], KVCacheBlock] = KVCacheBlock,
    ):
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)
        # The fresh blocks' node: ref_cnt counts the blocks it still stands for.
        self._fresh = KVCacheBlock(-2, ref_cnt=num_fresh)
        self._next_fresh, self._make_block = 0, make_block
        if num_fresh:
            self.append(self._fresh)
            self.num_free_blocks += num_fresh - 1

    def popleft(self) -> KVCacheBlock:
        """Take the block at the head (the next one to reuse)."""
        if not self.num_free_blocks:
            raise IndexError("no free blocks")
        return self.popleft_n(1)[0]

    def popleft_n(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` blocks from the head, in order."""
        if num_blocks > self.num_free_blocks:
            raise IndexError(f"{num_blocks} blocks asked for, {self.num_free_blocks} free")
        head, fresh = self._head, self._fresh
        taken = []
        for _ in range(num_blocks):
            block = head.next_free
            if block is fresh:
                block = self._make_block(self._next_fresh)
                self._next_fresh += 1
                fresh.ref_cnt -= 1
                if not fresh.ref_cnt:
                    self._unlink(fresh)
            else:
                self._unlink(block)
            taken.append(block)
        self.num_free_blocks -= num_blocks
        return taken

    def _unlink(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None

    def make_fresh_blocks(self) -> None:
        """Make the fresh blocks now and link them in their node's place."""
        fresh = self._fresh
        if not fresh.ref_cnt:
            return
        at = fresh.prev_free
        self._unlink(fresh)
        for _ in range(fresh.ref_cnt):
            block = self._make_block(self._next_fresh)
            self._next_fresh += 1
            block.prev_free, block.next_free = at, at.next_free
            at.next_free.prev_free = block
            at.next_free = at = block
        fresh.ref_cnt = 0

    def remove(self, block: KVCacheBlock) -> None:
        """Take ``block`` out of the queue, wherever it is."""
        assert block.prev_free is not None and block.next_free is not None, (
            f"{block} is not in the free queue"
        )
        self._unlink(block)
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the tail: reused last."""
        assert block.prev_free is None and block.next_free is None, f"{block} is already free"
        tail = self._tail
        block.prev_free = prev = tail.prev_free
        block.next_free = tail
        prev.next_free = tail.prev_free = block
        self.num_free_blocks += 1

    def appendleft(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the head: reused first."""
        assert block.prev_free is None and block.next_free is None, f"{block} is already free"
        head = self._head
        block.next_free = nxt = head.next_free
        block.prev_free = head
        head.next_free = nxt.prev_free = block
        self.num_free_blocks += 1

    def __iter__(self) -> Iterator[KVCacheBlock]:
        """The free blocks in order (the fresh ones are made first: for checks, not the hot
        path)."""
        self.make_fresh_blocks()
        block = self._head.next_free
        while block is not self._tail:
            yield block
            block = block.next_free

    def __len__(self) -> int:
        return self.num_free_blocks


class BlockPool:
    """All physical blocks of one KV cache, free or referenced.

    A block with refcount 0 is always in the free queue. Uncached free blocks (no hash) wait at
    the head, so they are reused before any cached block is evicted; cached ones join the tail,
    which makes the queue's cached part LRU. Taking a cached block from the queue to reuse it is
    an eviction: its hash leaves the map.
    """

    __slots__ = ("num_blocks", "_blocks", "free_queue", "cached_blocks", "num_evictions")

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        # Made when first taken from the free queue (in id order, so block i is _blocks[i]).
        self._blocks: list[KVCacheBlock] = []
        self.free_queue = FreeBlockQueue(num_fresh=num_blocks, make_block=self._make_block)
        self.cached_blocks: dict[BlockHash, KVCacheBlock] = {}
        self.num_evictions = 0

    def _make_block(self, block_id: int) -> KVCacheBlock:
        block = KVCacheBlock(block_id)
        self._blocks.append(block)
        return block

    @property
    def blocks(self) -> list[KVCacheBlock]:
        """Every block, by id (those never used are made now: for checks, not the hot path)."""
        self.free_queue.make_fresh_blocks()
        return self._blocks

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    def allocate(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` blocks from the head of the free queue, evicting cached ones."""
        if num_blocks > self.free_queue.num_free_blocks:
            raise ValueError(
                f"cannot allocate {num_blocks} blocks: only {self.num_free_blocks} are free"
            )
        new_blocks = self.free_queue.popleft_n(num_blocks)
        for block in new_blocks:
            if block.block_hash is not None:
                self._drop_hash(block)
                self.num_evictions += 1
            block.ref_cnt = 1
        return new_blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on each of ``blocks`` (prefix hits), lifting free ones out of the
        queue."""
        remove = self.free_queue.remove
        for block in blocks:
            if block.ref_cnt == 0:
                remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each of ``blocks``, in order; at zero a block is free at once."""
        queue = self.free_queue
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    queue.appendleft(block)
                else:
                    queue.append(block)

    def publish(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """Make a full block findable by its hash (a no-op when the hash is already taken)."""
        if block.block_hash is None and block_hash not in self.cached_blocks:
            block.block_hash = block_hash
            self.cached_blocks[block_hash] = block

    def unpublish(self, block: KVCacheBlock) -> None:
        """Forget a block's hash: its KV will never be computed."""
        if block.block_hash is not None:
            self._drop_hash(block)

    def _drop_hash(self, block: KVCacheBlock) -> None:
        assert self.cached_blocks.get(block.block_hash) is block
        del self.cached_blocks[block.block_hash]
        block.block_hash = None

    def get_cached_block(self, block_hash: BlockHash) -> Optional[KVCacheBlock]:
        """The block published under ``block_hash``, if any."""
        return self.cached_blocks.get(block_hash)

    def reset_prefix_cache(self) -> int:
        """Forget every published hash (blocks in use stay allocated); returns how many."""
        num_dropped = len(self.cached_blocks)
        for block in self.cached_blocks.values():
            block.block_hash = None
        self.cached_blocks.clear()
        return num_dropped
