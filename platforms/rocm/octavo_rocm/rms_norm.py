"""AITER-style fused residual add + RMSNorm (optionally quantised to FP8) for CDNA GPUs.

As AITER's Triton kernel does: a persistent grid (a fixed number of programs, about the number
of compute units, each walking rows ``pid, pid + P, ...``) so a step's few hundred rows do not
pay for a launch each, and rows wider than one block are processed in column blocks in two
passes (sum of squares, then normalise). Semantics of ``octavo.ops.reference.rms_norm``.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from octavo_triton.numerics import narrow
from octavo_triton.rms_norm import row_view
from octavo_triton.runtime import interpreting, next_power_of_2, upcast_loads


@triton.jit
def add_and_square_sum(
    x_ptr,
    residual_ptr,
    residual_out_ptr,
    cols,
    mask,
    HAS_RESIDUAL: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Load one column block (adding the residual, rounded and stored) and its sum of squares."""
    x = tl.load(x_ptr + cols, mask=mask, other=0.0)
    if UPCAST:
        x = x.to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + cols, mask=mask, other=0.0)
        if UPCAST:
            r = r.to(tl.float32)
        x = narrow(x + r, residual_out_ptr.dtype.element_ty, UPCAST)
        tl.store(residual_out_ptr + cols, x, mask=mask)
    h = x.to(tl.float32)
    return h, tl.sum(h * h, axis=0)


@triton.jit
def normalise_block(
    out_ptr, weight_ptr, h, rstd, cols, mask, DTYPE: tl.constexpr, UPCAST: tl.constexpr
):
    """``weight * (h * rstd rounded to the input dtype)``, stored."""
    normed = narrow(h * rstd, DTYPE, UPCAST).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + cols, narrow(w * normed, out_ptr.dtype.element_ty, UPCAST), mask=mask)


@triton.jit
def fused_add_rms_norm_kernel(
    out_ptr,
    residual_out_ptr,
    x_ptr,
    residual_ptr,
    weight_ptr,
    num_rows,
    num_cols,
    num_programs,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ONE_BLOCK: tl.constexpr,
):
    """Persistent: program ``pid`` normalises rows ``pid, pid + num_programs, ...``."""
    for row in tl.range(tl.program_id(0), num_rows, num_programs):
        row64 = tl.cast(row, tl.int64)
        x_row = x_ptr + row64 * stride_x
        r_row = residual_ptr + row64 * stride_r
        ro_row = residual_out_ptr + row64 * stride_ro
        o_row = out_ptr + row64 * stride_o
        if ONE_BLOCK:
            cols = tl.arange(0, BLOCK_N)
            mask = cols < num_cols
            h, square_sum = add_and_square_sum(
                x_row, r_row, ro_row, cols, mask, HAS_RESIDUAL, UPCAST
            )
            rstd = tl.rsqrt(square_sum / num_cols + eps)
            normalise_block(o_row, weight_ptr, h, rstd, cols, mask, x_ptr.dtype.element_ty, UPCAST)
        else:
            square_sum = tl.zeros([], tl.float32)
            for start in range(0, num_cols, BLOCK_N):
                cols = start + tl.arange(0, BLOCK_N)
                mask = cols < num_cols
                _, block_sum = add_and_square_sum(
                    x_row, r_row, ro_row, cols, mask, HAS_RESIDUAL, UPCAST
                )
                square_sum += block_sum
            rstd = tl.rsqrt(square_sum / num_cols + eps)
            tl.debug_barrier()  # the second pass rereads the sums the first one stored
            for start in range(0, num_cols, BLOCK_N):
                cols = start + tl.arange(0, BLOCK_N)
                mask = cols < num_cols
                if HAS_RESIDUAL:
                    h = tl.load(ro_row + cols, mask=mask, other=0.0).to(tl.float32)
                else:
                    h = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
                normalise_block(
                    o_row, weight_ptr, h, rstd, cols, mask, x_ptr.dtype.element_ty, UPCAST
                )


def make_rms_norm(
    hidden_size: int,
    eps: float,
    max_block: int = 8192,
    num_programs: int = 304,
    warp_size: int = 64,
):
    """Return ``fn(x, weight, residual=None)`` (the hook's contract). Rows up to ``max_block``
    wide take one block; wider rows are walked in ``max_block`` column blocks. ``num_programs``
    is the persistent grid (an MI300X has 304 compute units)."""
    block = min(next_power_of_2(hidden_size), max_block)
    one_block = block >= hidden_size
    interpret = interpreting()
    launch = {} if interpret else {"num_warps": max(1, min(16, block // (warp_size * 4)))}

    def rms_norm(x: torch.Tensor, weight: torch.Tensor, residual: Optional[torch.Tensor] = None):
        """``rms_norm(x) * weight``; with ``residual``:
        ``(rms_norm(x + residual) * weight, x + residual)``."""
        shape = x.shape
        x2 = row_view(x, hidden_size)
        rows = x2.shape[0]
        out = torch.empty(x2.shape, dtype=torch.result_type(weight, x), device=x.device)
        r2 = x2 if residual is None else row_view(residual, hidden_size)
        summed = out
        if residual is not None:
            summed = torch.empty(x2.shape, dtype=torch.result_type(x, residual), device=x.device)
        upcast = any(upcast_loads(t.dtype, interpret) for t in (x, weight, r2))
        if rows:
            programs = min(rows, num_programs)
            fused_add_rms_norm_kernel[(programs,)](
                out,
                summed,
                x2,
                r2,
                weight,
                rows,
                hidden_size,
                programs,
                x2.stride(0),
                r2.stride(0),
                out.stride(0),
                summed.stride(0),
                eps,
                HAS_RESIDUAL=residual is not None,
                UPCAST=upcast,
                BLOCK_N=block,
                ONE_BLOCK=one_block,
                **launch,
            )
        if residual is None:
            return out.view(shape)
        return out.view(shape), summed.view(shape)

    return rms_norm


_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@triton.jit
def fused_add_rms_norm_fp8_kernel(
    q_ptr,
    scale_ptr,
    residual_out_ptr,
    x_ptr,
    residual_ptr,
    weight_ptr,
    num_rows,
    num_cols,
    num_programs,
    stride_x,
    stride_r,
    stride_q,
    stride_ro,
    eps,
    fp8_max,
    min_scale,
    HAS_RESIDUAL: tl.constexpr,
    UPCAST: tl.constexpr,
    EMULATE_FP8: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Persistent, one block per row: the normalised row (rounded to ``OUT_DTYPE``, as the
    unquantised kernel returns it) quantised to FP8 with its own per-token scale."""
    for row in tl.range(tl.program_id(0), num_rows, num_programs):
        row64 = tl.cast(row, tl.int64)
        cols = tl.arange(0, BLOCK_N)
        mask = cols < num_cols
        h, square_sum = add_and_square_sum(
            x_ptr + row64 * stride_x,
            residual_ptr + row64 * stride_r,
            residual_out_ptr + row64 * stride_ro,
            cols,
            mask,
            HAS_RESIDUAL,
            UPCAST,
        )
        rstd = tl.rsqrt(square_sum / num_cols + eps)
        normed = narrow(h * rstd, x_ptr.dtype.element_ty, UPCAST).to(tl.float32)
        w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        y = narrow(w * normed, OUT_DTYPE, UPCAST).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(y), axis=0) / fp8_max, min_scale)
        tl.store(scale_ptr + row64, scale)
        q = tl.clamp(y / scale, -fp8_max, fp8_max)
        tl.store(
            q_ptr + row64 * stride_q + cols,
            narrow(q, q_ptr.dtype.element_ty, EMULATE_FP8),
            mask=mask,
        )


def make_rms_norm_fp8(
    hidden_size: int,
    eps: float,
    fp8_dtype: torch.dtype,
    max_block: int = 8192,
    num_programs: int = 304,
    warp_size: int = 64,
):
    """Return ``fn(x, weight, residual=None) -> (q, scale)`` or ``(q, scale, x + residual)``: the
    RMSNorm output quantised per token to ``fp8_dtype`` (``q * scale`` approximates it), in one
    pass, AITER's fused add + RMSNorm + quant. Rows must fit one block (``max_block``)."""
    block = next_power_of_2(hidden_size)
    if block > max_block:
        raise ValueError(f"fused RMSNorm+FP8 takes rows up to {max_block} wide, not {hidden_size}")
    fp8_max = float(torch.finfo(fp8_dtype).max)
    interpret = interpreting()
    launch = {} if interpret else {"num_warps": max(1, min(16, block // (warp_size * 4)))}

    def rms_norm_fp8(
        x: torch.Tensor, weight: torch.Tensor, residual: Optional[torch.Tensor] = None
    ):
        """``per_token_quant(rms_norm(x (+ residual)) * weight)`` (and ``x + residual``)."""
        x2 = row_view(x, hidden_size)
        rows = x2.shape[0]
        q = torch.empty(x2.shape, dtype=fp8_dtype, device=x.device)
        scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
        r2 = x2 if residual is None else row_view(residual, hidden_size)
        summed = q
        if residual is not None:
            summed = torch.empty(x2.shape, dtype=torch.result_type(x, residual), device=x.device)
        if rows:
            programs = min(rows, num_programs)
            fused_add_rms_norm_fp8_kernel[(programs,)](
                q,
                scale,
                summed,
                x2,
                r2,
                weight,
                rows,
                hidden_size,
                programs,
                x2.stride(0),
                r2.stride(0),
                q.stride(0),
                summed.stride(0),
                eps,
                fp8_max,
                1.0 / (fp8_max * 512.0),
                HAS_RESIDUAL=residual is not None,
                UPCAST=any(upcast_loads(t.dtype, interpret) for t in (x, weight, r2)),
                EMULATE_FP8=interpret,
                OUT_DTYPE=_TL_DTYPES[torch.result_type(weight, x)],
                BLOCK_N=block,
                **launch,
            )
        if residual is None:
            return q.view(x.shape), scale
        return q.view(x.shape), scale, summed.view(x.shape)

    return rms_norm_fp8
