"""Paged attention over the flat mixed batch (prefill chunks and decodes in one call), in Pallas.

KV cache layout, one array per layer: ``[2, num_blocks, num_kv_heads, block_size, head_dim]``
(K then V), so one block of one layer is a ``[num_kv_heads, block_size, head_dim]`` tile whose
last two dimensions are whole, as Mosaic's tiling wants.

The kernel's grid is ``(token, block of its request)``: each query token attends to the first
``context_lens[t]`` positions of its request (its own position included, so causality and
chunked prefill need no other mask), one KV block per grid step, with an online softmax kept
in VMEM scratch. The block table rides in SMEM as scalar prefetch and picks each step's block
in the BlockSpec's index map, so Pallas pipelines the block copies; steps past a token's
context re-use the last block's index (no copy) and skip the arithmetic. A TPU tuning pass
would tile several query tokens of one request per step; this one is written to be obviously
right first.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu


def kv_cache_shape(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
) -> tuple[int, ...]:
    return (2, num_blocks, num_kv_heads, block_size, head_dim)


def write_kv(kv_cache: jax.Array, key: jax.Array, value: jax.Array, slot_mapping: jax.Array):
    """The cache with ``key``/``value [T, num_kv_heads, head_dim]`` written at ``slot_mapping``
    (``block * block_size + offset``); slots past the cache (padding tokens) are dropped."""
    block_size = kv_cache.shape[3]
    blocks = jax.lax.div(slot_mapping, block_size)
    offsets = jax.lax.rem(slot_mapping, block_size)
    kv_cache = kv_cache.at[0, blocks, :, offsets].set(key.astype(kv_cache.dtype), mode="drop")
    return kv_cache.at[1, blocks, :, offsets].set(value.astype(kv_cache.dtype), mode="drop")


def copy_blocks(kv_cache: jax.Array, src: jax.Array, dst: jax.Array) -> jax.Array:
    """The cache with blocks ``src[i]`` copied over ``dst[i]`` (copy-on-write, swap in)."""
    return kv_cache.at[:, dst].set(kv_cache[:, src])


def _attention_kernel(
    token_rows_ref,  # scalar prefetch: [T] the token's row of the block table
    context_lens_ref,  # scalar prefetch: [T] positions the token sees (0: a padding token)
    block_table_ref,  # scalar prefetch: [R * max_blocks] flattened
    q_ref,  # [H, D] this token's query
    k_ref,  # [KVH, BS, D] one block of keys
    v_ref,  # [KVH, BS, D] one block of values
    o_ref,  # [H, D]
    m_scratch,  # [H, 1] running max
    l_scratch,  # [H, 1] running sum
    acc_scratch,  # [H, D] running weighted values
    *,
    scale: float,
    block_size: int,
    num_kv_heads: int,
    window: Optional[int],
    max_blocks: int,
):
    t, j = pl.program_id(0), pl.program_id(1)
    group = q_ref.shape[0] // num_kv_heads

    @pl.when(j == 0)
    def _init():
        m_scratch[...] = jnp.full(m_scratch.shape, -jnp.inf, jnp.float32)
        l_scratch[...] = jnp.zeros(l_scratch.shape, jnp.float32)
        acc_scratch[...] = jnp.zeros(acc_scratch.shape, jnp.float32)

    context = context_lens_ref[t]
    start = jnp.maximum(context - window, 0) if window else 0
    first = j * block_size

    @pl.when((first < context) & (first + block_size > start))
    def _one_block():
        q = q_ref[...].astype(jnp.float32) * scale
        position = first + jax.lax.broadcasted_iota(jnp.int32, (1, block_size), 1)
        visible = (position < context) & (position >= start)
        for h in range(num_kv_heads):  # static: 2-D matmuls per KV head (GQA groups)
            rows = slice(h * group, (h + 1) * group)
            k = k_ref[h].astype(jnp.float32)
            v = v_ref[h].astype(jnp.float32)
            s = jax.lax.dot_general(
                q[rows], k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
            )
            s = jnp.where(visible, s, -jnp.inf)
            m_prev = m_scratch[rows]
            m_new = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
            p = jnp.exp(s - m_new)
            alpha = jnp.exp(m_prev - m_new)
            l_scratch[rows] = alpha * l_scratch[rows] + p.sum(axis=1, keepdims=True)
            pv = jax.lax.dot_general(
                p, v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
            )
            acc_scratch[rows] = alpha * acc_scratch[rows] + pv
            m_scratch[rows] = m_new

    @pl.when(j == max_blocks - 1)
    def _write():
        total = l_scratch[...]
        seen = total > 0
        out = acc_scratch[...] / jnp.where(seen, total, 1.0)
        o_ref[...] = jnp.where(seen, out, 0.0).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "window", "interpret"))
def paged_attention(
    query: jax.Array,  # [T, H, D]
    kv_cache: jax.Array,  # [2, N, KVH, BS, D]
    token_rows: jax.Array,  # [T] int32
    context_lens: jax.Array,  # [T] int32: position + 1, or 0 for padding
    block_table: jax.Array,  # [R, max_blocks] int32
    *,
    scale: float,
    window: Optional[int] = None,
    interpret: bool = False,
) -> jax.Array:
    """``[T, H, D]``: each token's attention over its request's first ``context_lens[t]``
    cached positions (the last ``window`` of them with a sliding window); zeros for padding."""
    num_tokens, num_heads, head_dim = query.shape
    _, _, num_kv_heads, block_size, _ = kv_cache.shape
    max_blocks = block_table.shape[1]

    def kv_index(which):
        def index(t, j, token_rows, context_lens, block_table):
            last = jax.lax.div(jnp.maximum(context_lens[t] - 1, 0), block_size)
            return (which, block_table[token_rows[t] * max_blocks + jnp.minimum(j, last)], 0, 0, 0)

        return index

    kernel = functools.partial(
        _attention_kernel,
        scale=scale,
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        window=window,
        max_blocks=max_blocks,
    )
    kv_block = (None, None, num_kv_heads, block_size, head_dim)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(num_tokens, max_blocks),
        in_specs=[
            pl.BlockSpec((None, num_heads, head_dim), lambda t, j, *_: (t, 0, 0)),
            pl.BlockSpec(kv_block, kv_index(0)),
            pl.BlockSpec(kv_block, kv_index(1)),
        ],
        out_specs=pl.BlockSpec((None, num_heads, head_dim), lambda t, j, *_: (t, 0, 0)),
        scratch_shapes=[
            pltpu.VMEM((num_heads, 1), jnp.float32),
            pltpu.VMEM((num_heads, 1), jnp.float32),
            pltpu.VMEM((num_heads, head_dim), jnp.float32),
        ],
    )
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(query.shape, query.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
    )(token_rows, context_lens, block_table.reshape(-1), query, kv_cache, kv_cache)
