"""KVCacheManager: all the scheduler knows of KV memory."""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

from octavo.errors import ConfigError
from octavo.kv_cache.block_pool import BlockPool, KVCacheBlock
from octavo.kv_cache.hashing import BlockHasher
from octavo.kv_cache.stats import KVCacheStats, count_waste
from octavo.kv_cache.swap import HostBlockPool
from octavo.kv_cache.transfers import BlockTableUpdate, PendingCopies, TransferKind, TransferLog
from octavo.request import Request

_NO_COPIES = PendingCopies()


@dataclasses.dataclass(slots=True, eq=False)
class _RequestBlocks:
    """One request's block table and how far the manager has taken it."""

    blocks: list[KVCacheBlock]
    num_cached_blocks: int = 0  # leading blocks already offered to the prefix cache
    num_used_slots: int = 0  # tokens given a slot (computed or scheduled), lookahead excluded


class KVCacheManager:
    """Paged KV blocks for every request, with automatic prefix caching, forks and swap.

    The manager only keeps books: contents move when the worker applies ``take_pending_copies()``
    (copy-on-write and swap copies, in planning order) before each forward pass. Block hashes
    come from ``request.block_hashes``, so requests must be built with ``block_hasher`` set to
    this manager's ``block_hasher`` for prefix caching to find anything.

    Contract with the scheduler, within one scheduling pass: preempt (``free``/``swap_out``) before
    looking up new requests with ``get_computed_blocks``, and call ``free`` before resetting a
    preempted request's ``num_computed_tokens`` (blocks published for tokens that were never
    computed are withdrawn from the prefix cache on ``free``).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_caching: bool = True,
        hash_algo: str = "sha256",
        num_host_blocks: int = 0,
        recompute_last_cached_block: bool = False,
    ):
        """``recompute_last_cached_block``: a prefix-cache hit leaves out its last block (an
        EAGLE head's KV at a block's last position holds the token after it, which a request
        sharing only the prefix has its own of; recomputing the block writes it)."""
        if num_blocks < 1:
            raise ConfigError(f"the KV cache needs at least one block; got num_blocks={num_blocks}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.recompute_last_cached_block = recompute_last_cached_block
        self.block_hasher = BlockHasher(block_size, hash_algo)
        self.block_pool = BlockPool(num_blocks)
        self.host_pool = HostBlockPool(num_host_blocks)
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self._tables: dict[str, _RequestBlocks] = {}
        self._swapped: dict[str, list[int]] = {}
        self._transfers = TransferLog()
        self._table_updates: list[BlockTableUpdate] = []

    # --- lookups ---------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.free_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by requests."""
        return 1.0 - self.block_pool.free_queue.num_free_blocks / self.block_pool.num_blocks

    def get_block_ids(self, request_id: str, start: int = 0) -> list[int]:
        """The request's block table from logical block ``start`` on (empty when it holds no
        device blocks). Pass ``start`` to fetch only the blocks a worker has not seen yet."""
        entry = self._tables.get(request_id)
        return [] if entry is None else [block.block_id for block in entry.blocks[start:]]

    def get_num_blocks(self, request_id: str) -> int:
        """How many blocks the request's table holds."""
        entry = self._tables.get(request_id)
        return 0 if entry is None else len(entry.blocks)

    def get_host_block_ids(self, request_id: str) -> list[int]:
        """The host blocks a swapped-out request's KV waits in (empty when not swapped out)."""
        return list(self._swapped.get(request_id, ()))

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of the request's full blocks, and its length in tokens.

        Never the whole prompt: the last token is always recomputed for its logits. Counts one
        prefix-cache query of ``num_tokens`` tokens. The blocks are not referenced until they are
        passed to ``allocate_slots`` in the same scheduling pass.
        """
        if not self.enable_caching or request.skip_prefix_cache_lookup:
            return [], 0
        block_hashes = request.block_hashes
        num_lookup = min(len(block_hashes), (request.num_tokens - 1) // self.block_size)
        lookup = self.block_pool.cached_blocks.get
        hits: list[KVCacheBlock] = []
        for i in range(num_lookup):
            block = lookup(block_hashes[i])
            if block is None:
                break
            hits.append(block)
        if self.recompute_last_cached_block and hits:
            hits.pop()
        num_hit_tokens = len(hits) * self.block_size
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += num_hit_tokens
        return hits, num_hit_tokens

    # --- allocation ------------------------------------------------------------------------

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
        num_new_computed_tokens: int = 0,
        num_lookahead_tokens: int = 0,
    ) -> Optional[list[KVCacheBlock]]:
        """Slots for ``num_new_tokens`` tokens after the computed ones (plus lookahead slots).

        ``new_computed_blocks``/``num_new_computed_tokens`` are this pass's prefix hits from
        ``get_computed_blocks``. Returns the blocks appended to the request's table, or None
        (and changes nothing) when they do not fit even after evicting every cached block with
        refcount 0. Blocks the new tokens fill are published to the prefix cache at once. Writing
        into a shared, partly filled block first moves the request to a copy of it
        (copy-on-write, reported by ``take_pending_copies``).
        """
        block_size = self.block_size
        entry = self._tables.get(request.request_id)
        if entry is not None and not new_computed_blocks:
            # The decode fast path: the slots exist and no shared block is written.
            num_computed = request.num_computed_tokens
            num_used = num_computed + num_new_tokens
            blocks = entry.blocks
            if num_used + num_lookahead_tokens <= len(blocks) * block_size and (
                not num_computed % block_size or blocks[num_computed // block_size].ref_cnt == 1
            ):
                entry.num_used_slots = num_used
                if self.enable_caching and num_used // block_size > entry.num_cached_blocks:
                    self._publish_full_blocks(request, entry, num_used // block_size)
                return []
        blocks = entry.blocks if entry is not None else []
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_used = num_computed + num_new_tokens
        num_new_blocks = (
            -(-(num_used + num_lookahead_tokens) // block_size)
            - len(blocks)
            - len(new_computed_blocks)
        )
        cow_index = -1
        if num_computed % block_size and num_new_tokens:
            index = num_computed // block_size
            if index < len(blocks) and blocks[index].ref_cnt > 1:
                cow_index = index
        num_needed = max(num_new_blocks, 0) + (cow_index >= 0)
        pool = self.block_pool
        num_available = pool.free_queue.num_free_blocks
        if new_computed_blocks:  # hits lying in the free queue stop being free
            num_available -= sum(1 for block in new_computed_blocks if block.ref_cnt == 0)
        if num_needed > num_available:
            return None
        if entry is None:
            entry = self._tables[request.request_id] = _RequestBlocks(blocks)
        if new_computed_blocks:
            assert len(blocks) * block_size == request.num_computed_tokens, (
                "prefix hits must follow the table"
            )
            if entry.num_cached_blocks == len(blocks):
                entry.num_cached_blocks += len(new_computed_blocks)
            pool.touch(new_computed_blocks)
            blocks.extend(new_computed_blocks)
        if cow_index >= 0:
            self._copy_on_write(request.request_id, blocks, cow_index)
        new_blocks = pool.allocate(num_new_blocks) if num_new_blocks > 0 else []
        if new_blocks:
            blocks.extend(new_blocks)
        entry.num_used_slots = num_used
        if self.enable_caching and num_used // block_size > entry.num_cached_blocks:
            self._publish_full_blocks(request, entry, num_used // block_size)
        return new_blocks

    def release_unused_slots(self, request: Request, num_slots: int) -> None:
        """The last ``num_slots`` slots given this step hold no token after all (rejected
        drafts): they count as unused again. The blocks stay in the table for the next step."""
        entry = self._tables.get(request.request_id)
        if entry is not None:
            entry.num_used_slots = max(0, entry.num_used_slots - num_slots)

    def _copy_on_write(self, request_id: str, blocks: list[KVCacheBlock], index: int) -> None:
        src = blocks[index]
        (dst,) = self.block_pool.allocate(1)
        src.ref_cnt -= 1  # other tables still hold it, so it stays referenced
        blocks[index] = dst
        self._transfers.add(TransferKind.COPY, (src.block_id,), (dst.block_id,))
        self._table_updates.append(BlockTableUpdate(request_id, index, dst.block_id))

    def _publish_full_blocks(
        self, request: Request, entry: _RequestBlocks, num_full_blocks: int
    ) -> None:
        block_hashes = request.block_hashes
        end = min(num_full_blocks, len(block_hashes))
        if end <= entry.num_cached_blocks:
            return
        publish = self.block_pool.publish
        blocks = entry.blocks
        for i in range(entry.num_cached_blocks, end):
            publish(blocks[i], block_hashes[i])
        entry.num_cached_blocks = end

    def free(self, request: Request) -> None:
        """Drop the request's blocks, last block first; a block whose refcount reaches 0 is free
        at once (cached ones keep their hash until evicted). Also releases swapped-out host
        blocks."""
        entry = self._tables.pop(request.request_id, None)
        if entry is not None:
            self._release(request, entry)
        host_block_ids = self._swapped.pop(request.request_id, None)
        if host_block_ids is not None:
            self.host_pool.free(host_block_ids)

    def _release(self, request: Request, entry: _RequestBlocks) -> None:
        blocks = entry.blocks
        num_valid_blocks = request.num_computed_tokens // self.block_size
        # Blocks published for tokens that were scheduled but never computed hold no KV.
        for block in blocks[num_valid_blocks : entry.num_cached_blocks]:
            if block.ref_cnt == 1:
                self.block_pool.unpublish(block)
        self.block_pool.free_blocks(reversed(blocks))

    def fork(self, parent: Request, child: Request) -> None:
        """Give ``child`` the parent's computed blocks, shared (refcount + 1 each).

        ``child`` must have the parent's tokens and ``num_computed_tokens`` (``parent.fork(id)``).
        Call it between steps; the first write into a shared, partly filled block copies it.
        """
        entry = self._tables.get(parent.request_id)
        if entry is None:
            raise ValueError(f"cannot fork request {parent.request_id!r}: it holds no KV blocks")
        if child.request_id in self._tables or child.request_id in self._swapped:
            raise ValueError(
                f"cannot fork into request {child.request_id!r}: it already holds KV blocks"
            )
        if child.num_computed_tokens != parent.num_computed_tokens:
            raise ValueError(
                f"child {child.request_id!r} has num_computed_tokens={child.num_computed_tokens}, "
                f"parent {parent.request_id!r} has {parent.num_computed_tokens}; "
                "create the child with parent.fork()"
            )
        num_computed = parent.num_computed_tokens
        shared = entry.blocks[: -(-num_computed // self.block_size)]
        for block in shared:
            block.ref_cnt += 1
        num_cached = min(entry.num_cached_blocks, num_computed // self.block_size)
        self._tables[child.request_id] = _RequestBlocks(shared, num_cached, num_computed)

    # --- swap ------------------------------------------------------------------------------

    def swap_out(self, request: Request) -> Optional[list[tuple[int, int]]]:
        """Plan moving the request's computed KV to host blocks and free its device blocks.

        Returns ``[(device_block_id, host_block_id)]``, or None (and changes nothing) when the
        host pool is too small; the copies are also queued for ``take_pending_copies``.
        """
        entry = self._tables.get(request.request_id)
        if entry is None:
            raise ValueError(
                f"cannot swap out request {request.request_id!r}: it holds no KV blocks"
            )
        num_blocks = -(-request.num_computed_tokens // self.block_size)
        assert num_blocks <= len(entry.blocks)
        host_block_ids = self.host_pool.allocate(num_blocks)
        if host_block_ids is None:
            return None
        device_block_ids = [block.block_id for block in entry.blocks[:num_blocks]]
        self._transfers.add(TransferKind.SWAP_OUT, device_block_ids, host_block_ids)
        del self._tables[request.request_id]
        self._release(request, entry)
        self._swapped[request.request_id] = host_block_ids
        return list(zip(device_block_ids, host_block_ids))

    def swap_in(self, request: Request) -> Optional[list[tuple[int, int]]]:
        """Plan bringing a swapped-out request's KV back to device blocks.

        Full blocks still in the prefix cache are reused without a copy. Returns
        ``[(host_block_id, device_block_id)]`` for the blocks to copy, or None (and changes
        nothing) when the device blocks do not fit; the copies are also queued.
        """
        host_block_ids = self._swapped.get(request.request_id)
        if host_block_ids is None:
            raise ValueError(
                f"cannot swap in request {request.request_id!r}: it is not swapped out"
            )
        reused = self._cached_full_blocks(request, len(host_block_ids))
        num_fresh = sum(1 for block in reused if block is None)
        num_touched_free = sum(1 for block in reused if block is not None and block.ref_cnt == 0)
        if num_fresh > self.block_pool.free_queue.num_free_blocks - num_touched_free:
            return None
        self.block_pool.touch(block for block in reused if block is not None)
        fresh = iter(self.block_pool.allocate(num_fresh))
        blocks, mapping = [], []
        for host_block_id, block in zip(host_block_ids, reused):
            if block is None:
                block = next(fresh)
                mapping.append((host_block_id, block.block_id))
            blocks.append(block)
        self._transfers.add(TransferKind.SWAP_IN, [h for h, _ in mapping], [d for _, d in mapping])
        self.host_pool.free(host_block_ids)
        del self._swapped[request.request_id]
        entry = self._tables[request.request_id] = _RequestBlocks(
            blocks, 0, request.num_computed_tokens
        )
        if self.enable_caching:
            self._publish_full_blocks(
                request, entry, request.num_computed_tokens // self.block_size
            )
        return mapping

    def _cached_full_blocks(
        self, request: Request, num_blocks: int
    ) -> list[Optional[KVCacheBlock]]:
        reused: list[Optional[KVCacheBlock]] = [None] * num_blocks
        if self.enable_caching:
            lookup = self.block_pool.cached_blocks.get
            num_full = min(
                request.num_computed_tokens // self.block_size, len(request.block_hashes)
            )
            for i in range(num_full):
                reused[i] = lookup(request.block_hashes[i])
        return reused

    # --- per-step output and accounting ----------------------------------------------------

    def take_pending_copies(self) -> PendingCopies:
        """The KV copies and block-table rewrites planned since the last call, for the worker."""
        transfers = self._transfers.take()
        if not transfers and not self._table_updates:
            return _NO_COPIES
        updates = tuple(update for update in self._table_updates if self._is_current(update))
        self._table_updates.clear()
        return PendingCopies(transfers, updates)

    def _is_current(self, update: BlockTableUpdate) -> bool:
        entry = self._tables.get(update.request_id)
        return (
            entry is not None
            and update.block_index < len(entry.blocks)
            and entry.blocks[update.block_index].block_id == update.block_id
        )

    def reset_prefix_cache(self) -> int:
        """Forget every cached block hash (blocks in use stay allocated); returns how many."""
        return self.block_pool.reset_prefix_cache()

    def request_waste(self, request_id: str) -> int:
        """Slots allocated to the request that hold no token (below one block without lookahead)."""
        entry = self._tables.get(request_id)
        return 0 if entry is None else len(entry.blocks) * self.block_size - entry.num_used_slots

    def stats(self) -> KVCacheStats:
        """A snapshot for the metrics layer (O(running requests))."""
        pool = self.block_pool
        num_allocated_slots = (pool.num_blocks - pool.num_free_blocks) * self.block_size
        wasted, max_request_waste = count_waste(
            ((entry.blocks, entry.num_used_slots) for entry in self._tables.values()),
            self.block_size,
        )
        return KVCacheStats(
            num_blocks=pool.num_blocks,
            num_free_blocks=pool.num_free_blocks,
            num_cached_blocks=len(pool.cached_blocks),
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
            num_evictions=pool.num_evictions,
            num_allocated_slots=num_allocated_slots,
            num_used_slots=num_allocated_slots - wasted,
            max_request_waste=max_request_waste,
            num_running_requests=len(self._tables),
            num_host_blocks=self.host_pool.num_blocks,
            num_free_host_blocks=self.host_pool.num_free_blocks,
            num_swapped_requests=len(self._swapped),
        )
