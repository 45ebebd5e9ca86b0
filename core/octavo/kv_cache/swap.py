"""The host-memory pool that swapped-out requests keep their KV blocks in."""

from __future__ import annotations

from typing import Iterable, Optional


class HostBlockPool:
    """Host block ids, each owned by at most one swapped-out request (no sharing, no caching).

    Sized by ``--swap-space`` (see ``octavo.kv_cache.sizing.num_host_blocks``); 0 disables
    swapping, and then every swap-out plan fails so the scheduler recomputes instead.
    """

    __slots__ = ("num_blocks", "_free_ids", "_is_free")

    def __init__(self, num_blocks: int):
        if num_blocks < 0:
            raise ValueError(f"num_host_blocks must be >= 0; got {num_blocks}")
        self.num_blocks = num_blocks
        # Popped from the end: the lowest ids are handed out first.
        self._free_ids = list(range(num_blocks - 1, -1, -1))
        self._is_free = [True] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_ids)

    def allocate(self, num_blocks: int) -> Optional[list[int]]:
        """``num_blocks`` host block ids, or None when fewer are free."""
        if num_blocks > len(self._free_ids):
            return None
        taken = [self._free_ids.pop() for _ in range(num_blocks)]
        for block_id in taken:
            self._is_free[block_id] = False
        return taken

    def free(self, block_ids: Iterable[int]) -> None:
        """Give host blocks back."""
        for block_id in block_ids:
            assert not self._is_free[block_id], f"host block {block_id} freed twice"
            self._is_free[block_id] = True
            self._free_ids.append(block_id)

    def is_free(self, block_id: int) -> bool:
        return self._is_free[block_id]
