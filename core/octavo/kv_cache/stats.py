"""What the KV cache reports to the metrics layer."""

from __future__ import annotations

import dataclasses


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
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @property
    def fragmentation(self) -> int:
        """Allocated slots that hold no token."""
        return self.num_allocated_slots - self.num_used_slots

    @property
    def fragmentation_ratio(self) -> float:
        return self.fragmentation / self.num_allocated_slots if self.num_allocated_slots else 0.0
