"""What the KV cache reports to the metrics layer."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:
    from octavo.kv_cache.block_pool import KVCacheBlock


@dataclasses.dataclass(frozen=True, slots=True)
class KVCacheStats:
    """A snapshot of the KV cache.

    ``usage`` is the fraction of blocks referenced by requests. Prefix-cache queries and hits
    count tokens: a query is a lookup's prompt length, a hit the cached tokens it found.
    Slots are token positions: ``num_allocated_slots`` in referenced blocks (a shared block
    counts once), ``num_used_slots`` of them holding (or being given this step) a token's KV.
    """

    num_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_evictions: int
    num_allocated_slots: int
    num_used_slots: int
    max_request_waste: int
    num_running_requests: int
    num_host_blocks: int = 0
    num_free_host_blocks: int = 0
    num_swapped_requests: int = 0

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks if self.num_blocks else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return (
            self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
        )

    @property
    def fragmentation(self) -> int:
        """Allocated slots that hold no token."""
        return self.num_allocated_slots - self.num_used_slots

    @property
    def fragmentation_ratio(self) -> float:
        return self.fragmentation / self.num_allocated_slots if self.num_allocated_slots else 0.0


def count_waste(
    tables: Iterable[tuple[list["KVCacheBlock"], int]], block_size: int
) -> tuple[int, int]:
    """(empty slots in the referenced blocks, the largest waste of one table) for ``(block table,
    used slots)`` pairs. Only blocks at or past a table's first non-full one can hold empty slots;
    a block shared by several tables counts once."""
    waste_by_block: dict[int, int] = {}
    max_table_waste = 0
    for blocks, num_used in tables:
        max_table_waste = max(max_table_waste, len(blocks) * block_size - num_used)
        for i in range(num_used // block_size, len(blocks)):
            waste = block_size - max(0, num_used - i * block_size)
            block_id = blocks[i].block_id
            waste_by_block[block_id] = min(waste, waste_by_block.get(block_id, block_size))
    return sum(waste_by_block.values()), max_table_waste
