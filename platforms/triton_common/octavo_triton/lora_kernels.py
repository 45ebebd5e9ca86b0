"""The Triton kernels of the batched multi-LoRA products (``octavo_triton.lora`` launches them):
by token (BGMV) for decode steps, by segment (SGMV, ``tl.dot`` in IEEE float32) for prefill."""

from __future__ import annotations

import triton
import triton.language as tl

from octavo_triton.numerics import narrow


@triton.jit
def token_shrink_kernel(
    out_ptr,
    x_ptr,
    a_ptr,
    token_slots_ptr,
    K,
    R,
    stride_xt,
    stride_xk,
    stride_as,
    stride_ar,
    stride_ak,
    stride_ot,
    stride_or,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Grid ``(T, cdiv(R, BLOCK_R))``: ``out[t, ranks] = A[slot(t), ranks] @ x[t]`` in float32,
    zeros for a token of the base model."""
    token = tl.program_id(0).to(tl.int64)
    ranks = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    rank_ok = ranks < R
    slot = tl.load(token_slots_ptr + token)
    acc = tl.zeros([BLOCK_R, BLOCK_K], tl.float32)
    if slot >= 0:
        a_rows = a_ptr + slot * stride_as + ranks[:, None] * stride_ar
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            x = tl.load(x_ptr + token * stride_xt + ks * stride_xk, mask=k_ok, other=0.0)
            a = tl.load(
                a_rows + ks[None, :] * stride_ak, mask=rank_ok[:, None] & k_ok[None, :], other=0.0
            )
            acc += a.to(tl.float32) * x.to(tl.float32)[None, :]
    tl.store(out_ptr + token * stride_ot + ranks * stride_or, tl.sum(acc, axis=1), mask=rank_ok)


@triton.jit
def token_expand_kernel(
    y_ptr,
    buffer_ptr,
    b_ptr,
    token_slots_ptr,
    N,
    R,
    offset,
    stride_yt,
    stride_yn,
    stride_ut,
    stride_ur,
    stride_bs,
    stride_bn,
    stride_br,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    EMULATE: tl.constexpr,
):
    """Grid ``(T, cdiv(N, BLOCK_N))``: ``y[t, offset + cols] += B[slot(t), cols] @ buffer[t]``
    summed in float32 and rounded once; a token of the base model is left alone."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(token_slots_ptr + token)
    if slot >= 0:
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        b_rows = b_ptr + slot * stride_bs + cols[:, None] * stride_bn
        acc = tl.zeros([BLOCK_N, BLOCK_R], tl.float32)
        for r0 in range(0, R, BLOCK_R):
            ranks = r0 + tl.arange(0, BLOCK_R)
            rank_ok = ranks < R
            u = tl.load(buffer_ptr + token * stride_ut + ranks * stride_ur, mask=rank_ok, other=0.0)
            b = tl.load(
                b_rows + ranks[None, :] * stride_br,
                mask=col_ok[:, None] & rank_ok[None, :],
                other=0.0,
            )
            acc += b.to(tl.float32) * u.to(tl.float32)[None, :]
        y_at = y_ptr + token * stride_yt + (offset + cols) * stride_yn
        y = tl.load(y_at, mask=col_ok, other=0.0).to(tl.float32) + tl.sum(acc, axis=1)
        tl.store(y_at, narrow(y, y_ptr.dtype.element_ty, EMULATE), mask=col_ok)


# --- by segment (SGMV) -----------------------------------------------------------------------


@triton.jit
def segment_tile(sorted_tokens_ptr, segment_starts_ptr, BLOCK_M: tl.constexpr):
    """The tokens of this program's tile of its segment (``program_id(0)`` is the segment,
    ``program_id(1)`` the tile): ``(tokens, in_tile, tile is not empty)``."""
    segment = tl.program_id(0)
    start = tl.load(segment_starts_ptr + segment)
    end = tl.load(segment_starts_ptr + segment + 1)
    first = start + tl.program_id(1) * BLOCK_M
    positions = first + tl.arange(0, BLOCK_M)
    in_tile = positions < end
    tokens = tl.load(sorted_tokens_ptr + positions, mask=in_tile, other=0)
    return tokens, in_tile, first < end


@triton.jit
def segment_shrink_kernel(
    out_ptr,
    x_ptr,
    a_ptr,
    sorted_tokens_ptr,
    segment_slots_ptr,
    segment_starts_ptr,
    K,
    R,
    stride_xt,
    stride_xk,
    stride_as,
    stride_ar,
    stride_ak,
    stride_ot,
    stride_or,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Grid ``(G, cdiv(longest segment, BLOCK_M), cdiv(R, BLOCK_R))``: ``out[tokens, ranks] =
    x[tokens] @ A[slot, ranks].T`` for one tile of one segment's tokens, float32 accumulation.
    Rows of the base model's tokens are not written (the caller zeroes ``out``)."""
    tokens, in_tile, busy = segment_tile(sorted_tokens_ptr, segment_starts_ptr, BLOCK_M)
    if busy:
        slot = tl.load(segment_slots_ptr + tl.program_id(0))
        ranks = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
        rank_ok = ranks < R
        x_rows = x_ptr + tokens[:, None] * stride_xt
        a_cols = a_ptr + slot * stride_as + ranks[None, :] * stride_ar
        acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            x = tl.load(
                x_rows + ks[None, :] * stride_xk, mask=in_tile[:, None] & k_ok[None, :], other=0.0
            )
            a = tl.load(
                a_cols + ks[:, None] * stride_ak, mask=k_ok[:, None] & rank_ok[None, :], other=0.0
            )
            if UPCAST:
                x = x.to(tl.float32)
                a = a.to(tl.float32)
            acc = tl.dot(x, a, acc, input_precision="ieee")
        tl.store(
            out_ptr + tokens[:, None] * stride_ot + ranks[None, :] * stride_or,
            acc,
            mask=in_tile[:, None] & rank_ok[None, :],
        )


@triton.jit
def segment_expand_kernel(
    y_ptr,
    buffer_ptr,
    b_ptr,
    sorted_tokens_ptr,
    segment_slots_ptr,
    segment_starts_ptr,
    N,
    R,
    offset,
    stride_yt,
    stride_yn,
    stride_ut,
    stride_ur,
    stride_bs,
    stride_bn,
    stride_br,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    EMULATE: tl.constexpr,
):
    """Grid ``(G, cdiv(longest segment, BLOCK_M), cdiv(N, BLOCK_N))``: ``y[tokens, offset +
    cols] += buffer[tokens] @ B[slot, cols].T`` for one tile of one segment's tokens, the
    product in IEEE float32 and the sum rounded once into ``y``'s dtype."""
    tokens, in_tile, busy = segment_tile(sorted_tokens_ptr, segment_starts_ptr, BLOCK_M)
    if busy:
        slot = tl.load(segment_slots_ptr + tl.program_id(0))
        cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        u_rows = buffer_ptr + tokens[:, None] * stride_ut
        b_cols = b_ptr + slot * stride_bs + cols[None, :] * stride_bn
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for r0 in range(0, R, BLOCK_R):
            ranks = r0 + tl.arange(0, BLOCK_R)
            rank_ok = ranks < R
            u = tl.load(
                u_rows + ranks[None, :] * stride_ur,
                mask=in_tile[:, None] & rank_ok[None, :],
                other=0.0,
            )
            b = tl.load(
                b_cols + ranks[:, None] * stride_br,
                mask=rank_ok[:, None] & col_ok[None, :],
                other=0.0,
            )
            acc = tl.dot(u.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        y_at = y_ptr + tokens[:, None] * stride_yt + (offset + cols)[None, :] * stride_yn
        y_ok = in_tile[:, None] & col_ok[None, :]
        y = tl.load(y_at, mask=y_ok, other=0.0).to(tl.float32) + acc
        tl.store(y_at, narrow(y, y_ptr.dtype.element_ty, EMULATE), mask=y_ok)


# --- the platform's LoRAKernels ----------------------------------------------------------------
