"""How many KV blocks fit: from the memory budget and the model's shape."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

import torch

from octavo.config import CacheConfig
from octavo.errors import ConfigError
from octavo.platform.types import Capabilities, MemoryInfo

SUPPORTED_BLOCK_SIZES = (1, 8, 16, 32, 64, 128)
GiB = 1 << 30


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / GiB:.2f} GiB"


def check_block_size(block_size: int, platform_block_sizes: Optional[Sequence[int]] = None) -> int:
    """``block_size`` if the core and the platform both support it, else ConfigError listing which
    do."""
    allowed = [
        b
        for b in SUPPORTED_BLOCK_SIZES
        if platform_block_sizes is None or b in platform_block_sizes
    ]
    if block_size not in allowed:
        raise ConfigError(
            f"block_size {block_size} is not supported here; "
            f"choose --block-size from {', '.join(map(str, allowed))}"
        )
    return block_size


def bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Bytes of one block across all layers: K and V, each ``block_size x kv_heads x head_dim``."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize


def num_gpu_blocks(
    *,
    block_bytes: int,
    total_memory: int,
    model_memory: int,
    gpu_memory_utilization: float = 0.90,
    kv_cache_memory: Optional[int] = None,
    block_size: int = 16,
    max_model_len: Optional[int] = None,
) -> int:
    """Device blocks in the budget: ``kv_cache_memory`` bytes when given, else
    ``gpu_memory_utilization x total_memory - model_memory`` (weights and peak activations).

    Raises ConfigError, saying how much memory is needed, when one ``max_model_len`` request
    would not fit.
    """
    if kv_cache_memory is not None:
        budget = kv_cache_memory
    else:
        budget = int(gpu_memory_utilization * total_memory) - model_memory
    num_blocks = max(budget, 0) // block_bytes
    if max_model_len is None:
        if num_blocks < 1:
            raise ConfigError(
                f"the KV cache budget ({_gib(max(budget, 0))}) "
                f"holds no block of {_gib(block_bytes)}"
            )
        return num_blocks
    needed_blocks = -(-max_model_len // block_size)
    if num_blocks < needed_blocks:
        needed_bytes = needed_blocks * block_bytes
        if kv_cache_memory is not None:
            fix = f"raise --kv-cache-memory to at least {_gib(needed_bytes)}"
        else:
            utilization = math.ceil(100 * (needed_bytes + model_memory) / total_memory) / 100
            fix = (
                f"raise --gpu-memory-utilization to at least {utilization:.2f} (needs "
                f"{_gib(needed_bytes + model_memory)} of {_gib(total_memory)}) "
                f"or set --kv-cache-memory {_gib(needed_bytes)}"
            )
        raise ConfigError(
            f"the KV cache budget ({_gib(max(budget, 0))}) holds {num_blocks} blocks of "
            f"{block_size} tokens, but one request of max_model_len={max_model_len} needs "
            f"{needed_blocks} blocks ({_gib(needed_bytes)}); "
            f"{fix}, or lower --max-model-len"
        )
    return num_blocks


def num_host_blocks(swap_space_gib: float, block_bytes: int) -> int:
    """Host blocks for swapped-out requests in ``--swap-space`` GiB."""
    return int(swap_space_gib * GiB) // block_bytes


@dataclasses.dataclass(frozen=True)
class KVCacheSizing:
    """The KV cache's dimensions, decided once at start-up."""

    block_size: int
    block_bytes: int
    num_gpu_blocks: int
    num_host_blocks: int


def plan_kv_cache(
    cache_config: CacheConfig,
    capabilities: Capabilities,
    memory: MemoryInfo,
    *,
    model_memory: int,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    max_model_len: int,
    extra_block_bytes: int = 0,
    layout_block_bytes: Optional[int] = None,
) -> KVCacheSizing:
    """Block size, device and host block counts for one model on one platform;
    ``extra_block_bytes`` are a draft model's KV bytes in each block (its caches share the
    target's block ids). ``layout_block_bytes``, where the caller has the attention backends'
    layouts (a latent-attention model's one row per token), replaces the K-and-V-per-head
    count of the model's own layers."""
    block_size = check_block_size(cache_config.block_size, capabilities.block_sizes)
    block_bytes = layout_block_bytes
    if block_bytes is None:
        block_bytes = bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype)
    block_bytes += extra_block_bytes
    num_blocks = num_gpu_blocks(
        block_bytes=block_bytes,
        total_memory=memory.total,
        model_memory=model_memory,
        gpu_memory_utilization=cache_config.gpu_memory_utilization,
        kv_cache_memory=cache_config.kv_cache_memory,
        block_size=block_size,
        max_model_len=max_model_len,
    )
    return KVCacheSizing(
        block_size, block_bytes, num_blocks, num_host_blocks(cache_config.swap_space, block_bytes)
    )
