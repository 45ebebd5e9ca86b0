"""Paged attention over the flat mixed batch (prefill chunks and decodes in one call), in Pallas.

KV cache layout, one array per layer: ``[2, num_blocks, num_kv_heads, block_size, head_dim]``
(K then V), so one block of one layer is a ``[num_kv_heads, block_size, head_dim]`` tile whose
last two dimensions are whole, as Mosaic's tiling wants.

The kernel's grid is the query tokens: each attends to the first ``context_lens[t]`` positions
of its request (its own position included, so causality and chunked prefill need no other
mask). The cache stays where it is (``memory_space=ANY``); the kernel walks the token's blocks
through the block table (scalar prefetch, in SMEM) and copies each block's K and V into VMEM
by DMA, keeping an online softmax. Only the blocks a token sees are read (with a sliding
window, only those inside it). A TPU tuning pass would tile several query tokens of one
request per program and double-buffer the copies; this one is written to be obviously right
first.
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
    kv_ref,  # [2, N, KVH, BS, D] the whole cache, in place
    o_ref,  # [H, D]
    k_buf,  # VMEM [KVH, BS, D]: one block of keys
    v_buf,  # VMEM [KVH, BS, D]: one block of values
    copies,  # DMA semaphores [2]
    *,
    scale: float,
    num_kv_heads: int,
    window: Optional[int],
    max_blocks: int,
):
    t = pl.program_id(0)
    num_heads, head_dim = q_ref.shape
    block_size = k_buf.shape[1]
    group = num_heads // num_kv_heads
    context = context_lens_ref[t]
    start = jnp.maximum(context - window, 0) if window else jnp.int32(0)
    row_start = token_rows_ref[t] * max_blocks
    q = q_ref[...].astype(jnp.float32) * scale

    def one_block(j, carry):
        m, total, acc = carry
        block = block_table_ref[row_start + j]
        copy_k = pltpu.make_async_copy(kv_ref.at[0, block], k_buf, copies.at[0])
        copy_v = pltpu.make_async_copy(kv_ref.at[1, block], v_buf, copies.at[1])
        copy_k.start()
        copy_v.start()
        copy_k.wait()
        copy_v.wait()
        position = j * block_size + jax.lax.broadcasted_iota(jnp.int32, (1, block_size), 1)
        visible = (position < context) & (position >= start)
        heads = []
        for h in range(num_kv_heads):  # static: 2-D matmuls per KV head (GQA groups)
            rows = slice(h * group, (h + 1) * group)
            s = jax.lax.dot_general(
                q[rows],
                k_buf[h].astype(jnp.float32),
                (((1,), (1,)), ((), ())),
                preferred_element_type=jnp.float32,
            )
            s = jnp.where(visible, s, -jnp.inf)
            m_new = jnp.maximum(m[rows], s.max(axis=1, keepdims=True))
            p = jnp.exp(s - m_new)
            alpha = jnp.exp(m[rows] - m_new)
            pv = jax.lax.dot_general(
                p,
                v_buf[h].astype(jnp.float32),
                (((1,), (0,)), ((), ())),
                preferred_element_type=jnp.float32,
            )
            heads.append(
                (m_new, alpha * total[rows] + p.sum(axis=1, keepdims=True), alpha * acc[rows] + pv)
            )
        return tuple(jnp.concatenate(parts) for parts in zip(*heads))

    init = (
        jnp.full((num_heads, 1), -jnp.inf, jnp.float32),
        jnp.zeros((num_heads, 1), jnp.float32),
        jnp.zeros((num_heads, head_dim), jnp.float32),
    )
    blocks = (jax.lax.div(start, block_size), jax.lax.div(context + block_size - 1, block_size))
    _, total, acc = jax.lax.fori_loop(*blocks, one_block, init)
    seen = total > 0
    out = acc / jnp.where(seen, total, 1.0)
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
    kernel = functools.partial(
        _attention_kernel,
        scale=scale,
        num_kv_heads=num_kv_heads,
        window=window,
        max_blocks=block_table.shape[1],
    )
    per_token = pl.BlockSpec((None, num_heads, head_dim), lambda t, *_: (t, 0, 0))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(num_tokens,),
        in_specs=[per_token, pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=per_token,
        scratch_shapes=[
            pltpu.VMEM((num_kv_heads, block_size, head_dim), kv_cache.dtype),
            pltpu.VMEM((num_kv_heads, block_size, head_dim), kv_cache.dtype),
            pltpu.SemaphoreType.DMA((2,)),
        ],
    )
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(query.shape, query.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=interpret,
    )(token_rows, context_lens, block_table.reshape(-1), query, kv_cache)
