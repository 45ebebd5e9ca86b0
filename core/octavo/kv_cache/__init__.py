"""Paged KV cache bookkeeping: blocks, prefix caching, forks, swap and sizing."""

from octavo.kv_cache.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from octavo.kv_cache.hashing import BlockHash, BlockHasher
from octavo.kv_cache.manager import KVCacheManager
from octavo.kv_cache.sizing import (
    KVCacheSizing,
    bytes_per_block,
    check_block_size,
    num_gpu_blocks,
    plan_kv_cache,
)
from octavo.kv_cache.stats import KVCacheStats
from octavo.kv_cache.swap import HostBlockPool
from octavo.kv_cache.transfers import (
    BlockTableUpdate,
    BlockTransfer,
    PendingCopies,
    TransferKind,
    allocate_host_caches,
    apply_block_transfers,
)

__all__ = [
    "BlockHash",
    "BlockHasher",
    "BlockPool",
    "BlockTableUpdate",
    "BlockTransfer",
    "FreeBlockQueue",
    "HostBlockPool",
    "KVCacheBlock",
    "KVCacheManager",
    "KVCacheSizing",
    "KVCacheStats",
    "PendingCopies",
    "TransferKind",
    "allocate_host_caches",
    "apply_block_transfers",
    "bytes_per_block",
    "check_block_size",
    "num_gpu_blocks",
    "plan_kv_cache",
]
