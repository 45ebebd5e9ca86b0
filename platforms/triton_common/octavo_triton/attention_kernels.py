"""Triton kernels of paged attention: the KV write through ``slot_mapping`` and the unified
attention over a flat batch that mixes prefill chunks and decodes.

KV layout (octavo's default): ``[2, num_blocks, block_size, num_kv_heads, head_dim]``, passed as
two views (K and V) with their strides. Query, key and value are ``[T, heads, head_dim]`` with a
unit stride along ``head_dim``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from octavo_triton.numerics import narrow


@triton.jit
def write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    num_slots,
    stride_key_tok,
    stride_key_head,
    stride_value_tok,
    stride_value_head,
    stride_kc_block,
    stride_kc_slot,
    stride_kc_head,
    stride_vc_block,
    stride_vc_slot,
    stride_vc_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
):
    """``BLOCK_T`` new tokens per program: copy their K and V (all KV heads) to their slots;
    a slot of -1 is skipped. Offsets are int64: a large cache overflows int32."""
    tokens = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    slot = tl.load(slot_mapping_ptr + tokens, mask=tokens < num_slots, other=-1).to(tl.int64)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    tok = tokens[:, None, None]
    heads = tl.arange(0, HEADS_PAD)[None, :, None]
    dims = tl.arange(0, HEAD_DIM_PAD)[None, None, :]
    mask = (slot >= 0)[:, None, None] & (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
    k = tl.load(key_ptr + tok * stride_key_tok + heads * stride_key_head + dims, mask=mask)
    v = tl.load(value_ptr + tok * stride_value_tok + heads * stride_value_head + dims, mask=mask)
    k_slot = (block * stride_kc_block + offset * stride_kc_slot)[:, None, None]
    v_slot = (block * stride_vc_block + offset * stride_vc_slot)[:, None, None]
    k_dst = k_cache_ptr + k_slot + heads * stride_kc_head + dims
    v_dst = v_cache_ptr + v_slot + heads * stride_vc_head + dims
    tl.store(k_dst, narrow(k, k_cache_ptr.dtype.element_ty, EMULATE_BF16), mask=mask)
    tl.store(v_dst, narrow(v, v_cache_ptr.dtype.element_ty, EMULATE_BF16), mask=mask)


@triton.jit
def find_request(query_start_loc_ptr, num_reqs, pid, BLOCK_Q: tl.constexpr):
    """The request owning global query block ``pid``: the largest ``r`` with
    ``query_start_loc[r] // BLOCK_Q + r <= pid`` (strictly increasing in ``r``)."""
    lo = tl.zeros([], tl.int64)
    hi = num_reqs.to(tl.int64) - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        lo = tl.where(first_block <= pid, mid, lo)
        hi = tl.where(first_block <= pid, hi, mid - 1)
    return lo


@triton.jit
def attend_tile(
    q,
    m_i,
    l_i,
    acc,
    q_pos,
    tile_start,
    kv_end,
    k_cache_ptr,
    v_cache_ptr,
    block_table_row_ptr,
    kv_head,
    scale,
    stride_kc_block,
    stride_kc_slot,
    stride_kc_head,
    stride_vc_block,
    stride_vc_slot,
    stride_vc_head,
    SLIDING_WINDOW: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    TILE_N: tl.constexpr,
    UPCAST: tl.constexpr,
    PV_PRECISION: tl.constexpr,
):
    """One online-softmax step over context positions ``tile_start .. tile_start + TILE_N``."""
    k_pos = tile_start + tl.arange(0, TILE_N)
    k_ok = k_pos < kv_end
    dims = tl.arange(0, HEAD_DIM_PAD)
    d_ok = dims < HEAD_DIM
    block = tl.load(block_table_row_ptr + k_pos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
    offset = k_pos % BLOCK_SIZE
    k_ptr = (
        k_cache_ptr + block * stride_kc_block + offset * stride_kc_slot + kv_head * stride_kc_head
    )
    k = tl.load(k_ptr[None, :] + dims[:, None], mask=d_ok[:, None] & k_ok[None, :], other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
    s = tl.dot(q, k, input_precision="ieee") * scale
    visible = k_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])
    if SLIDING_WINDOW > 0:
        visible = visible & (k_pos[None, :] > q_pos[:, None] - SLIDING_WINDOW)
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v_ptr = (
        v_cache_ptr + block * stride_vc_block + offset * stride_vc_slot + kv_head * stride_vc_head
    )
    v = tl.load(v_ptr[:, None] + dims[None, :], mask=k_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        v = v.to(tl.float32)
    if PV_PRECISION == "low":
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    else:
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision=PV_PRECISION)
    return m_new, l_i, acc


@triton.jit
def unified_attention_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    scale,
    num_reqs,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_bt_req,
    stride_kc_block,
    stride_kc_slot,
    stride_kc_head,
    stride_vc_block,
    stride_vc_slot,
    stride_vc_head,
    partial_ptr,
    max_ptr,
    sum_ptr,
    segment_len,
    GQA: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,
    UPCAST: tl.constexpr,
    PV_PRECISION: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
):
    """Grid ``(T // BLOCK_Q + R, num_kv_heads, NUM_SEGMENTS)``: a program takes up to ``BLOCK_Q``
    new tokens of one request and the ``GQA`` query heads of one KV head, and walks that
    request's context through its block table with an online softmax, causal inside the new
    tokens. With ``NUM_SEGMENTS > 1`` (split-KV, for long contexts and few requests) program
    ``s`` walks context positions ``[s * segment_len, (s + 1) * segment_len)`` (the last one to
    the end) and stores its unnormalised partial result for :func:`merge_segments_kernel`."""
    pid = tl.program_id(0).to(tl.int64)  # int64 index math: no overflow on large caches
    kv_head = tl.program_id(1).to(tl.int64)
    req = find_request(query_start_loc_ptr, num_reqs, pid, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + req).to(tl.int64)
    q_len = tl.load(query_start_loc_ptr + req + 1).to(tl.int64) - q_start
    q_block = pid - (q_start // BLOCK_Q + req)
    if q_block * BLOCK_Q < q_len:
        seq_len = tl.load(seq_lens_ptr + req).to(tl.int64)
        context_len = seq_len - q_len
        rows = tl.arange(0, BLOCK_M)
        tok = q_block * BLOCK_Q + rows // GQA
        head = kv_head * GQA + rows % GQA
        row_ok = (rows // GQA < BLOCK_Q) & (tok < q_len)
        dims = tl.arange(0, HEAD_DIM_PAD)
        d_ok = dims < HEAD_DIM
        q_off = (q_start + tok)[:, None] * stride_q_tok + head[:, None] * stride_q_head
        q = tl.load(q_ptr + q_off + dims[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        q_pos = context_len + tok
        first_pos = context_len + q_block * BLOCK_Q
        kv_end = context_len + tl.minimum(q_block * BLOCK_Q + BLOCK_Q, q_len)
        kv_start = 0
        if SLIDING_WINDOW > 0:
            kv_start = tl.maximum(first_pos - SLIDING_WINDOW + 1, 0) // TILE_N * TILE_N
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
        block_table_row_ptr = block_table_ptr + req * stride_bt_req
        walk_end = kv_end
        if NUM_SEGMENTS > 1:
            segment = tl.program_id(2)
            kv_start = tl.maximum(kv_start, segment * segment_len)
            if segment < NUM_SEGMENTS - 1:
                walk_end = tl.minimum(kv_end, (segment + 1) * segment_len)
        for tile_start in range(kv_start, walk_end, TILE_N):
            m_i, l_i, acc = attend_tile(
                q,
                m_i,
                l_i,
                acc,
                q_pos,
                tile_start,
                walk_end,
                k_cache_ptr,
                v_cache_ptr,
                block_table_row_ptr,
                kv_head,
                scale,
                stride_kc_block,
                stride_kc_slot,
                stride_kc_head,
                stride_vc_block,
                stride_vc_slot,
                stride_vc_head,
                SLIDING_WINDOW,
                BLOCK_SIZE,
                HEAD_DIM,
                HEAD_DIM_PAD,
                TILE_N,
                UPCAST,
                PV_PRECISION,
            )
        if NUM_SEGMENTS > 1:
            # partials [T, H, S, HEAD_DIM_PAD], maxima and sums [T, H, S]
            slot = (
                (q_start + tok) * (tl.num_programs(1) * GQA) + head
            ) * NUM_SEGMENTS + tl.program_id(2)
            tl.store(max_ptr + slot, m_i, mask=row_ok)
            tl.store(sum_ptr + slot, l_i, mask=row_ok)
            tl.store(
                partial_ptr + slot[:, None] * HEAD_DIM_PAD + dims[None, :],
                acc,
                mask=row_ok[:, None],
            )
        else:
            out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
            o_off = (q_start + tok)[:, None] * stride_o_tok + head[:, None] * stride_o_head
            tl.store(
                out_ptr + o_off + dims[None, :],
                narrow(out, out_ptr.dtype.element_ty, UPCAST),
                mask=row_ok[:, None] & d_ok[None, :],
            )


@triton.jit
def merge_segments_kernel(
    out_ptr,
    partial_ptr,
    max_ptr,
    sum_ptr,
    query_start_loc_ptr,
    num_reqs,
    num_heads,
    stride_o_tok,
    stride_o_head,
    NUM_SEGMENTS: tl.constexpr,
    SEGMENTS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    EMULATE: tl.constexpr,
):
    """Grid ``(T, num_heads)``: one token's head from its segments' partial softmax results
    (rescaled to the largest maximum); padding tokens are left alone."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    if token < tl.load(query_start_loc_ptr + num_reqs):
        segments = tl.arange(0, SEGMENTS_PAD)
        s_ok = segments < NUM_SEGMENTS
        slot = (token * num_heads + head) * NUM_SEGMENTS + segments
        m = tl.load(max_ptr + slot, mask=s_ok, other=float("-inf"))
        sums = tl.load(sum_ptr + slot, mask=s_ok, other=0.0)
        m_max = tl.max(m, axis=0)
        weight = tl.exp(m - tl.where(m_max == float("-inf"), 0.0, m_max))
        dims = tl.arange(0, HEAD_DIM_PAD)
        acc = tl.load(
            partial_ptr + slot[:, None] * HEAD_DIM_PAD + dims[None, :],
            mask=s_ok[:, None],
            other=0.0,
        )
        total = tl.sum(sums * weight, axis=0)
        out = tl.sum(acc * weight[:, None], axis=0) / tl.where(total == 0.0, 1.0, total)
        tl.store(
            out_ptr + token * stride_o_tok + head * stride_o_head + dims,
            narrow(out, out_ptr.dtype.element_ty, EMULATE),
            mask=dims < HEAD_DIM,
        )
