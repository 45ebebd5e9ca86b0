"""The attention layer: the platform's paged-attention backend and this layer's KV cache."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from octavo.platform.facade import Platform
from octavo.platform.types import AttentionMetadata, AttentionSpec


class Attention(nn.Module):
    """Paged attention over one layer's KV cache.

    The backend is resolved from the platform once, at construction, and owns the cache layout;
    the model runner allocates ``kv_cache`` with ``backend.kv_cache_shape(num_blocks)`` and binds
    it here before the first step. Inputs and output are flat ``[T, heads, head_dim]``.
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        platform: Platform,
        *,
        dtype: torch.dtype,
        block_size: int,
        scale: Optional[float] = None,
        sliding_window: Optional[int] = None,
    ):
        super().__init__()
        self.spec = AttentionSpec(
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            dtype=dtype,
            block_size=block_size,
            scale=head_dim**-0.5 if scale is None else scale,
            sliding_window=sliding_window,
        )
        self.backend = platform.attention_backend(self.spec)
        self.kv_cache: Optional[torch.Tensor] = None

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        assert self.kv_cache is not None, "the model runner binds KV caches before the first step"
        tokens = query.shape[0]
        spec = self.spec
        return self.backend.forward(
            query.view(tokens, spec.num_heads, spec.head_dim),
            key.view(tokens, spec.num_kv_heads, spec.head_dim),
            value.view(tokens, spec.num_kv_heads, spec.head_dim),
            self.kv_cache,
            attn_metadata,
        )

    def extra_repr(self) -> str:
        s = self.spec
        return (
            f"heads={s.num_heads}, kv_heads={s.num_kv_heads}, head_dim={s.head_dim}, "
            f"backend={self.backend.name}"
        )
