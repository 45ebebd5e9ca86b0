"""Triton kernels of multi-head latent attention (MLA, DeepSeek-V2/V3): the row write through
``slot_mapping`` and the paged attention in the latent space over a flat mixed batch
(``octavo_triton.mla`` launches them).

Cache layout (the :class:`~octavo.platform.types.MLAAttentionBackend` contract): ``[num_blocks,
block_size, LATENT + ROPE]``, one row per token (its latent, then its rotary key) shared by
every head, unit stride along the row. Queries are ``[T, heads, LATENT + ROPE]`` (the key
up-projection already absorbed), outputs ``[T, heads, LATENT]``: a cached row is both the key
(all of it) and the value (its latent).

The row is read as two tiles, the latent and the rotary part, each padded to a power of two
and masked: DeepSeek-V3's 512 + 64 would otherwise pad to 1024, and widths such as 20 + 6 need
masks anyway. The score is the sum of the two parts' dot products.
"""

from __future__ import annotations

import triton
import triton.language as tl

from octavo_triton.attention_kernels import find_request
from octavo_triton.numerics import narrow


@triton.jit
def write_rows_kernel(
    row_ptr,
    cache_ptr,
    slot_mapping_ptr,
    num_slots,
    stride_row,
    stride_c_block,
    stride_c_slot,
    WIDTH: tl.constexpr,
    WIDTH_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    EMULATE: tl.constexpr,
):
    """``BLOCK_T`` new tokens per program: copy each token's row to its slot; a slot of -1
    is skipped. Offsets are int64: a large cache overflows int32."""
    tokens = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    slot = tl.load(slot_mapping_ptr + tokens, mask=tokens < num_slots, other=-1).to(tl.int64)
    cols = tl.arange(0, WIDTH_PAD)
    mask = (slot >= 0)[:, None] & (cols < WIDTH)[None, :]
    row = tl.load(row_ptr + tokens[:, None] * stride_row + cols[None, :], mask=mask)
    dst = (slot // BLOCK_SIZE) * stride_c_block + (slot % BLOCK_SIZE) * stride_c_slot
    tl.store(
        cache_ptr + dst[:, None] + cols[None, :],
        narrow(row, cache_ptr.dtype.element_ty, EMULATE),
        mask=mask,
    )


@triton.jit
def mla_tile(
    q_lat,
    q_rope,
    m_i,
    l_i,
    acc,
    q_pos,
    tile_start,
    kv_end,
    cache_ptr,
    block_table_row_ptr,
    scale,
    stride_c_block,
    stride_c_slot,
    LATENT: tl.constexpr,
    LATENT_PAD: tl.constexpr,
    ROPE: tl.constexpr,
    ROPE_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    UPCAST: tl.constexpr,
    PV_PRECISION: tl.constexpr,
):
    """One online-softmax step over context positions ``tile_start .. tile_start + TILE_N``:
    the rows are gathered slot by slot through the block table, scored against both query
    parts, and their latents (the same tile) accumulated into ``acc`` in float32."""
    k_pos = tile_start + tl.arange(0, TILE_N)
    k_ok = k_pos < kv_end
    block = tl.load(block_table_row_ptr + k_pos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
    row = cache_ptr + block * stride_c_block + (k_pos % BLOCK_SIZE) * stride_c_slot
    lat_dims = tl.arange(0, LATENT_PAD)
    rope_dims = tl.arange(0, ROPE_PAD)
    lat_mask = k_ok[:, None] & (lat_dims < LATENT)[None, :]
    rope_mask = k_ok[:, None] & (rope_dims < ROPE)[None, :]
    lat = tl.load(row[:, None] + lat_dims[None, :], mask=lat_mask, other=0.0)
    rope = tl.load(row[:, None] + LATENT + rope_dims[None, :], mask=rope_mask, other=0.0)
    if UPCAST:
        lat = lat.to(tl.float32)
        rope = rope.to(tl.float32)
    s = tl.dot(q_lat, tl.trans(lat), input_precision="ieee")
    s += tl.dot(q_rope, tl.trans(rope), input_precision="ieee")
    s = s * scale
    s = tl.where(k_ok[None, :] & (k_pos[None, :] <= q_pos[:, None]), s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet
    p = tl.exp(s - m_ref[:, None])
    rescale = tl.exp(m_i - m_ref)
    l_i = l_i * rescale + tl.sum(p, axis=1)
    if PV_PRECISION == "low":
        pv = tl.dot(p.to(lat.dtype), lat)
    else:
        pv = tl.dot(p, lat.to(tl.float32), input_precision=PV_PRECISION)
    return m_new, l_i, acc * rescale[:, None] + pv


@triton.jit
def load_query(
    q_row,
    row_ok,
    LATENT: tl.constexpr,
    LATENT_PAD: tl.constexpr,
    ROPE: tl.constexpr,
    ROPE_PAD: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """The query rows at ``q_row`` as their latent part ``[M, LATENT_PAD]`` and rotary part
    ``[M, ROPE_PAD]``, zeros past the widths and in rows that are not ``row_ok``."""
    lat_dims = tl.arange(0, LATENT_PAD)
    rope_dims = tl.arange(0, ROPE_PAD)
    lat_mask = row_ok[:, None] & (lat_dims < LATENT)[None, :]
    rope_mask = row_ok[:, None] & (rope_dims < ROPE)[None, :]
    q_lat = tl.load(q_row[:, None] + lat_dims[None, :], mask=lat_mask, other=0.0)
    q_rope = tl.load(q_row[:, None] + LATENT + rope_dims[None, :], mask=rope_mask, other=0.0)
    if UPCAST:
        q_lat = q_lat.to(tl.float32)
        q_rope = q_rope.to(tl.float32)
    return q_lat, q_rope


@triton.jit
def mla_walk(
    q_lat,
    q_rope,
    q_pos,
    kv_end,
    cache_ptr,
    block_table_row_ptr,
    scale,
    stride_c_block,
    stride_c_slot,
    LATENT: tl.constexpr,
    LATENT_PAD: tl.constexpr,
    ROPE: tl.constexpr,
    ROPE_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    UPCAST: tl.constexpr,
    PV_PRECISION: tl.constexpr,
):
    """The normalised float32 output ``[BLOCK_M, LATENT_PAD]`` of query rows at positions
    ``q_pos`` over context positions ``0 .. kv_end``, ``TILE_N`` at a time from position 0
    (the same tiles whatever else is in the batch); a row that sees nothing gets zeros."""
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, LATENT_PAD], tl.float32)
    for tile_start in range(0, kv_end, TILE_N):
        m_i, l_i, acc = mla_tile(
            q_lat,
            q_rope,
            m_i,
            l_i,
            acc,
            q_pos,
            tile_start,
            kv_end,
            cache_ptr,
            block_table_row_ptr,
            scale,
            stride_c_block,
            stride_c_slot,
            LATENT,
            LATENT_PAD,
            ROPE,
            ROPE_PAD,
            BLOCK_SIZE,
            TILE_N,
            UPCAST,
            PV_PRECISION,
        )
    return acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]


@triton.jit
def mla_attention_kernel(
    out_ptr,
    q_ptr,
    cache_ptr,
    block_table_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    scale,
    num_reqs,
    num_heads,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_bt_req,
    stride_c_block,
    stride_c_slot,
    LATENT: tl.constexpr,
    LATENT_PAD: tl.constexpr,
    ROPE: tl.constexpr,
    ROPE_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,
    UPCAST: tl.constexpr,
    PV_PRECISION: tl.constexpr,
):
    """Grid ``(T // BLOCK_Q + R, cdiv(heads, BLOCK_H))``: up to ``BLOCK_Q`` new tokens of one
    request times ``BLOCK_H`` heads (query rows that all read the same cached rows) over the
    request's context, causal inside the new tokens; padding tokens are left alone."""
    pid = tl.program_id(0).to(tl.int64)  # int64 index math: no overflow on large caches
    req = find_request(query_start_loc_ptr, num_reqs, pid, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + req).to(tl.int64)
    q_len = tl.load(query_start_loc_ptr + req + 1).to(tl.int64) - q_start
    q_block = pid - (q_start // BLOCK_Q + req)
    if q_block * BLOCK_Q < q_len:
        context_len = tl.load(seq_lens_ptr + req).to(tl.int64) - q_len
        rows = tl.arange(0, BLOCK_Q * BLOCK_H)
        tok = q_block * BLOCK_Q + rows // BLOCK_H
        head = tl.program_id(1) * BLOCK_H + rows % BLOCK_H
        row_ok = (tok < q_len) & (head < num_heads)
        q_row = q_ptr + (q_start + tok) * stride_q_tok + head * stride_q_head
        q_lat, q_rope = load_query(q_row, row_ok, LATENT, LATENT_PAD, ROPE, ROPE_PAD, UPCAST)
        out = mla_walk(
            q_lat,
            q_rope,
            context_len + tok,
            context_len + tl.minimum(q_block * BLOCK_Q + BLOCK_Q, q_len),
            cache_ptr,
            block_table_ptr + req * stride_bt_req,
            scale,
            stride_c_block,
            stride_c_slot,
            LATENT,
            LATENT_PAD,
            ROPE,
            ROPE_PAD,
            BLOCK_SIZE,
            BLOCK_Q * BLOCK_H,
            TILE_N,
            UPCAST,
            PV_PRECISION,
        )
        o_row = out_ptr + (q_start + tok) * stride_o_tok + head * stride_o_head
        tl.store(
            o_row[:, None] + tl.arange(0, LATENT_PAD)[None, :],
            narrow(out, out_ptr.dtype.element_ty, UPCAST),
            mask=row_ok[:, None] & (tl.arange(0, LATENT_PAD) < LATENT)[None, :],
        )
