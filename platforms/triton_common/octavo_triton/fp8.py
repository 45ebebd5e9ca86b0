"""FP8 (e4m3) scaled matmul and dynamic per-token FP8 quantisation of activations.

``scaled_mm(a, b, scale_a, scale_b, out_dtype, bias=None)`` is ``(a @ b) * scale_a * scale_b
(+ bias)`` accumulated in float32, as ``octavo.ops.reference.scaled_mm``: ``scale_a`` per tensor
``[1]`` or per token ``[M, 1]``, ``scale_b`` per tensor or per output channel ``[1, N]``.
Chips without FP8 types (sm_80: Triton rejects e4m3 there outright) get the operands as raw
bytes, widened to float16 in registers by bit moves, which is exact for every e4m3 value.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from octavo_triton.numerics import narrow
from octavo_triton.runtime import interpreting, next_power_of_2
from octavo_triton.tuning import MatmulTuning


@triton.jit
def e4m3_bytes_to_fp16(byte):
    """e4m3 (OCP, bias 7) bytes as float16 values scaled by 2**-8: sign, exponent and mantissa
    move into float16's fields unchanged (bias 15), subnormals included; exact."""
    bits = byte.to(tl.int16)
    fp16_bits = ((bits & 0x80) << 8) | ((bits & 0x7F) << 7)
    return fp16_bits.to(tl.float16, bitcast=True)


@triton.jit
def scaled_mm_kernel(
    out_ptr,
    a_ptr,
    b_ptr,
    scale_a_ptr,
    scale_b_ptr,
    bias_ptr,
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    stride_om,
    stride_on,
    PER_TOKEN_A: tl.constexpr,
    PER_CHANNEL_B: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    WIDEN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EMULATE: tl.constexpr,
):
    """One ``BLOCK_M x BLOCK_N`` output tile; tiles are visited in groups of ``GROUP_M`` rows
    of tiles so neighbouring programs share operand tiles in L2."""
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * tiles_n)
    first_m = group * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    tile_m = first_m + (pid % (GROUP_M * tiles_n)) % group_rows
    tile_n = (pid % (GROUP_M * tiles_n)) // group_rows
    rows = tile_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = k0 + ks < K
        a = tl.load(
            a_ptr + rows[:, None] * stride_am + (k0 + ks)[None, :] * stride_ak,
            mask=(rows < M)[:, None] & k_ok[None, :],
            other=0.0,
        )
        b = tl.load(
            b_ptr + (k0 + ks)[:, None] * stride_bk + cols[None, :] * stride_bn,
            mask=k_ok[:, None] & (cols < N)[None, :],
            other=0.0,
        )
        if WIDEN:
            a = e4m3_bytes_to_fp16(a)
            b = e4m3_bytes_to_fp16(b)
        acc = tl.dot(a, b, acc)
    if WIDEN:
        acc = acc * 65536.0  # both operands were scaled by 2**-8
    if PER_TOKEN_A:
        acc = acc * tl.load(scale_a_ptr + rows, mask=rows < M, other=0.0)[:, None]
    else:
        acc = acc * tl.load(scale_a_ptr)
    if PER_CHANNEL_B:
        acc = acc * tl.load(scale_b_ptr + cols, mask=cols < N, other=0.0)[None, :]
    else:
        acc = acc * tl.load(scale_b_ptr)
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(
        out_ptr + rows[:, None] * stride_om + cols[None, :] * stride_on,
        narrow(acc, out_ptr.dtype.element_ty, EMULATE),
        mask=(rows < M)[:, None] & (cols < N)[None, :],
    )


def make_scaled_mm(tuning: MatmulTuning = MatmulTuning(), widen: bool = False):
    """Return ``fn(a, b, scale_a, scale_b, out_dtype, bias=None)`` (the hook's contract)."""
    interpret = interpreting()
    launch = {} if interpret else {"num_warps": tuning.num_warps, "num_stages": tuning.num_stages}

    def scaled_mm(
        a: torch.Tensor,
        b: torch.Tensor,
        scale_a: torch.Tensor,
        scale_b: torch.Tensor,
        out_dtype: torch.dtype,
        bias: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """``(a @ b) * scale_a * scale_b (+ bias)``, float32 accumulation, in ``out_dtype``."""
        (M, K), (K2, N) = a.shape, b.shape
        if K != K2:
            raise ValueError(f"scaled_mm: a is {tuple(a.shape)} but b is {tuple(b.shape)}")
        out = torch.empty(M, N, dtype=out_dtype, device=a.device)
        if M == 0 or N == 0:
            return out
        if widen:
            if a.dtype != torch.float8_e4m3fn or b.dtype != torch.float8_e4m3fn:
                raise ValueError(
                    f"widened scaled_mm takes float8_e4m3fn operands, not {a.dtype}/{b.dtype}"
                )
            a, b = a.view(torch.uint8), b.view(torch.uint8)
        scale_a = scale_a.float().reshape(-1).contiguous()
        scale_b = scale_b.float().reshape(-1).contiguous()
        grid = (triton.cdiv(M, tuning.block_m) * triton.cdiv(N, tuning.block_n),)
        scaled_mm_kernel[grid](
            out,
            a,
            b,
            scale_a,
            scale_b,
            bias if bias is not None else scale_b,
            M,
            N,
            K,
            a.stride(0),
            a.stride(1),
            b.stride(0),
            b.stride(1),
            out.stride(0),
            out.stride(1),
            PER_TOKEN_A=scale_a.numel() > 1,
            PER_CHANNEL_B=scale_b.numel() > 1,
            HAS_BIAS=bias is not None,
            WIDEN=widen,
            BLOCK_M=tuning.block_m,
            BLOCK_N=tuning.block_n,
            BLOCK_K=tuning.block_k,
            GROUP_M=tuning.group_m,
            EMULATE=interpret,
            **launch,
        )
        return out

    return scaled_mm


@triton.jit
def per_token_quant_kernel(
    q_ptr,
    scale_ptr,
    x_ptr,
    K,
    stride_x,
    stride_q,
    fp8_max,
    min_scale,
    BLOCK_K: tl.constexpr,
    EMULATE: tl.constexpr,
):
    """One row: ``scale = max(amax(|x|) / fp8_max, min_scale)``, ``q = clamp(x / scale)``."""
    row = tl.program_id(0).to(tl.int64)
    amax = tl.zeros([], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * stride_x + ks, mask=ks < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(x), axis=0))
    scale = tl.maximum(amax / fp8_max, min_scale)
    tl.store(scale_ptr + row, scale)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * stride_x + ks, mask=ks < K, other=0.0).to(tl.float32)
        q = tl.clamp(x / scale, -fp8_max, fp8_max)
        tl.store(
            q_ptr + row * stride_q + ks, narrow(q, q_ptr.dtype.element_ty, EMULATE), mask=ks < K
        )


def make_per_token_quant(fp8_dtype: torch.dtype = torch.float8_e4m3fn, block_k: int = 2048):
    """Return ``fn(x [M, K]) -> (q [M, K] fp8, scale [M, 1] float32)``: dynamic per-token FP8
    quantisation of activations, ``x ~= q * scale`` row by row."""
    fp8_max = float(torch.finfo(fp8_dtype).max)
    min_scale = 1.0 / (fp8_max * 512.0)  # an all-zero row still gets a usable scale
    interpret = interpreting()

    def per_token_quant(x: torch.Tensor):
        """Quantise each row of ``x`` to ``fp8_dtype`` with its own float32 scale."""
        x2 = x if x.stride(-1) == 1 else x.contiguous()
        M, K = x2.shape
        q = torch.empty(M, K, dtype=fp8_dtype, device=x.device)
        scale = torch.empty(M, 1, dtype=torch.float32, device=x.device)
        if M:
            per_token_quant_kernel[(M,)](
                q,
                scale,
                x2,
                K,
                x2.stride(0),
                q.stride(0),
                fp8_max,
                min_scale,
                BLOCK_K=min(block_k, next_power_of_2(K)),
                EMULATE=interpret,
            )
        return q, scale

    return per_token_quant
