"""The JAX runner's paged KV cache: one device array per layer in the Pallas kernel's layout,
host arrays for swapped-out blocks, and the block transfers the scheduler plans."""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from octavo.kv_cache.transfers import BlockTransfer, TransferKind
from octavo_tpu.kernels.attention import copy_blocks, kv_cache_shape


class JaxKVCache:
    """``caches[layer]``: ``[2, num_blocks, num_kv_heads, block_size, head_dim]`` on the
    device; ``host_caches[layer]``: the same layout in host memory (numpy)."""

    def __init__(self, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype):
        self.num_layers, self.block_size = num_layers, block_size
        self.num_kv_heads, self.head_dim, self.dtype = num_kv_heads, head_dim, dtype
        self.caches: list[jax.Array] = []
        self.host_caches: list[np.ndarray] = []
        self.num_blocks = 0
        self._copy = jax.jit(copy_blocks, donate_argnums=(0,))

    def bytes_per_block(self) -> int:
        shape = kv_cache_shape(1, self.block_size, self.num_kv_heads, self.head_dim)
        return self.num_layers * int(np.prod(shape)) * jnp.dtype(self.dtype).itemsize

    def allocate(self, num_blocks: int, num_host_blocks: int, device) -> None:
        shape = kv_cache_shape(num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        self.caches = [
            jax.device_put(jnp.zeros(shape, self.dtype), device) for _ in range(self.num_layers)
        ]
        host_shape = kv_cache_shape(
            num_host_blocks, self.block_size, self.num_kv_heads, self.head_dim
        )
        self.host_caches = (
            [np.zeros(host_shape, jnp.dtype(self.dtype)) for _ in range(self.num_layers)]
            if num_host_blocks
            else []
        )
        self.num_blocks = num_blocks

    def apply(self, transfers: Sequence[BlockTransfer]) -> None:
        """Perform ``transfers`` in order on every layer (copy-on-write on the device, swap
        out to and in from the host caches)."""
        for transfer in transfers:
            src, dst = np.asarray(transfer.src, np.int32), np.asarray(transfer.dst, np.int32)
            if transfer.kind is TransferKind.COPY:
                self.caches = [self._copy(cache, src, dst) for cache in self.caches]
                continue
            if not self.host_caches:
                raise RuntimeError(
                    "swap requested but no host KV cache was allocated (num_host_blocks=0)"
                )
            for layer, cache in enumerate(self.caches):
                if transfer.kind is TransferKind.SWAP_OUT:
                    self.host_caches[layer][:, dst] = np.asarray(cache[:, src])
                else:
                    blocks = jax.device_put(self.host_caches[layer][:, src], cache.devices().pop())
                    self.caches[layer] = cache.at[:, dst].set(blocks)
