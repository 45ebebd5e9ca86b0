"""The Triton kernels of the fused Mixture-of-Experts layer (``octavo_triton.fused_moe`` routes
the tokens, sorts them into blocks and launches these).

A step's ``M = T * top_k`` (token, expert) pairs are numbered ``pair = token * top_k + k``; the
launcher sorts them by expert into blocks of ``BLOCK_M`` pairs of one expert each (an expert's
last block padded with the id ``M``), so one program multiplies one block's rows by one tile of
its expert's weights with ``tl.dot`` (float32 accumulation; IEEE float32 for float32 operands,
no TF32). Two grouped GEMMs:

- gate/up: ``act[pair] = silu(x[token] @ gate.T) * (x[token] @ up.T)``, both halves of
  ``w13[expert]`` in one program (the activation fused into the epilogue, rounded once);
- down: ``out[pair] = weight[pair] * (act[pair] @ w2[expert].T)``, the routing weight
  multiplied in float32 before the one rounding.

Blocks past the step's last expert block (the grid covers the most blocks a step can need)
do nothing. Programs walk the blocks in groups of ``GROUP_M`` per tile of outputs, so
neighbouring programs read the same expert's weight tiles.
"""

from __future__ import annotations

import triton
import triton.language as tl

from octavo_triton.numerics import narrow


@triton.jit
def block_and_tile(num_blocks, N, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """This program's ``(block of pairs, tile of N outputs)`` in grouped order: ``GROUP_M``
    blocks for each tile, then the next tile."""
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first = (pid // per_group) * GROUP_M
    group_blocks = tl.minimum(num_blocks - first, GROUP_M)
    block = first + (pid % per_group) % group_blocks
    tile_n = (pid % per_group) // group_blocks
    return block, tile_n


@triton.jit
def gate_up_kernel(
    act_ptr,
    x_ptr,
    w13_ptr,
    sorted_pairs_ptr,
    block_experts_ptr,
    num_blocks,
    num_pairs,
    num_experts,
    top_k,
    H,
    inner,
    stride_xt,
    stride_xh,
    stride_we,
    stride_wn,
    stride_wh,
    stride_am,
    stride_ai,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EMULATE: tl.constexpr,
):
    """Grid ``(num_blocks * cdiv(inner, BLOCK_N),)``: ``act[pairs, cols] = silu(gate) * up``
    for one block of pairs of one expert, ``gate``/``up`` its rows ``cols`` / ``inner + cols``
    of ``w13[expert]`` times the pairs' tokens, in float32, rounded once into ``act``."""
    block, tile_n = block_and_tile(num_blocks, inner, BLOCK_N, GROUP_M)
    expert = tl.load(block_experts_ptr + block)
    if expert < num_experts:
        pairs = tl.load(sorted_pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
        pair_ok = pairs < num_pairs
        tokens = pairs // top_k
        cols = tile_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < inner
        x_rows = x_ptr + tokens[:, None] * stride_xt
        gate_cols = w13_ptr + expert * stride_we + cols[None, :] * stride_wn
        up_cols = gate_cols + inner * stride_wn
        gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, H, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < H
            x = tl.load(
                x_rows + ks[None, :] * stride_xh, mask=pair_ok[:, None] & k_ok[None, :], other=0.0
            )
            w_ok = k_ok[:, None] & col_ok[None, :]
            w_gate = tl.load(gate_cols + ks[:, None] * stride_wh, mask=w_ok, other=0.0)
            w_up = tl.load(up_cols + ks[:, None] * stride_wh, mask=w_ok, other=0.0)
            if UPCAST:
                x = x.to(tl.float32)
                w_gate = w_gate.to(tl.float32)
                w_up = w_up.to(tl.float32)
            gate = tl.dot(x, w_gate, gate, input_precision="ieee")
            up = tl.dot(x, w_up, up, input_precision="ieee")
        act = gate * tl.sigmoid(gate) * up
        tl.store(
            act_ptr + pairs[:, None] * stride_am + cols[None, :] * stride_ai,
            narrow(act, act_ptr.dtype.element_ty, EMULATE),
            mask=pair_ok[:, None] & col_ok[None, :],
        )


@triton.jit
def down_kernel(
    out_ptr,
    act_ptr,
    w2_ptr,
    weights_ptr,
    sorted_pairs_ptr,
    block_experts_ptr,
    num_blocks,
    num_pairs,
    num_experts,
    H,
    inner,
    stride_om,
    stride_oh,
    stride_am,
    stride_ai,
    stride_we,
    stride_wh,
    stride_wi,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EMULATE: tl.constexpr,
):
    """Grid ``(num_blocks * cdiv(H, BLOCK_N),)``: ``out[pairs, cols] = weights[pairs] *
    (act[pairs] @ w2[expert, cols].T)`` for one block of pairs of one expert, in float32,
    rounded once into ``out``."""
    block, tile_n = block_and_tile(num_blocks, H, BLOCK_N, GROUP_M)
    expert = tl.load(block_experts_ptr + block)
    if expert < num_experts:
        pairs = tl.load(sorted_pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
        pair_ok = pairs < num_pairs
        cols = tile_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < H
        act_rows = act_ptr + pairs[:, None] * stride_am
        w_cols = w2_ptr + expert * stride_we + cols[None, :] * stride_wh
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, inner, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < inner
            a = tl.load(
                act_rows + ks[None, :] * stride_ai,
                mask=pair_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            w = tl.load(
                w_cols + ks[:, None] * stride_wi, mask=k_ok[:, None] & col_ok[None, :], other=0.0
            )
            if UPCAST:
                a = a.to(tl.float32)
                w = w.to(tl.float32)
            acc = tl.dot(a, w, acc, input_precision="ieee")
        weight = tl.load(weights_ptr + pairs, mask=pair_ok, other=0.0).to(tl.float32)
        tl.store(
            out_ptr + pairs[:, None] * stride_om + cols[None, :] * stride_oh,
            narrow(acc * weight[:, None], out_ptr.dtype.element_ty, EMULATE),
            mask=pair_ok[:, None] & col_ok[None, :],
        )
