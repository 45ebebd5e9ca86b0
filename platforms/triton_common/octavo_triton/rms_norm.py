"""Fused residual add + RMSNorm: one program per row, the whole row in one block.

Semantics of ``octavo.ops.reference.rms_norm`` (HuggingFace Llama): the residual is added in
the input dtype, statistics are taken in float32, the normalised row is rounded to the input
dtype and then multiplied by ``weight``.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from octavo_triton.numerics import narrow
from octavo_triton.runtime import interpreting, next_power_of_2, upcast_loads
from octavo_triton.tuning import RowTuning


@triton.jit
def rms_norm_kernel(
    out_ptr,
    residual_out_ptr,
    x_ptr,
    residual_ptr,
    weight_ptr,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    num_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """``out[row] = weight * rms_norm(x[row] (+ residual[row]))``; the sum is stored too."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < num_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if UPCAST:
        x = x.to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        if UPCAST:
            r = r.to(tl.float32)
        # round the sum to the input dtype, as the reference adds in that dtype
        x = narrow(x + r, residual_out_ptr.dtype.element_ty, UPCAST)
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=mask)
    h = x.to(tl.float32)
    variance = tl.sum(h * h, axis=0) / num_cols
    normed = narrow(h * tl.rsqrt(variance + eps), x_ptr.dtype.element_ty, UPCAST).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = narrow(w * normed, out_ptr.dtype.element_ty, UPCAST)
    tl.store(out_ptr + row * stride_o + cols, y, mask=mask)


def row_view(t: torch.Tensor, hidden_size: int) -> torch.Tensor:
    """``t`` as ``[rows, hidden_size]`` with unit column stride (a copy only when needed)."""
    t = t.reshape(-1, hidden_size)
    return t if t.stride(-1) == 1 else t.contiguous()


def warps_for(block: int, warp_size: int) -> int:
    """Enough warps that each thread holds about eight elements of the row (1 to 16)."""
    return max(1, min(16, block // (warp_size * 8)))


def make_rms_norm(hidden_size: int, eps: float, tuning: RowTuning = RowTuning()):
    """Return ``fn(x, weight, residual=None)`` for rows of ``hidden_size`` (the hook's contract)."""
    block = next_power_of_2(hidden_size)
    if block > tuning.max_block:
        raise ValueError(
            f"hidden size {hidden_size} exceeds the RMSNorm kernel's {tuning.max_block}"
        )
    interpret = interpreting()
    launch = {} if interpret else {"num_warps": warps_for(block, tuning.warp_size)}

    def rms_norm(x: torch.Tensor, weight: torch.Tensor, residual: Optional[torch.Tensor] = None):
        """``rms_norm(x) * weight``; with ``residual``:
        ``(rms_norm(x + residual) * weight, x + residual)``."""
        shape = x.shape
        x2 = row_view(x, hidden_size)
        out = torch.empty(x2.shape, dtype=torch.result_type(weight, x), device=x.device)
        rows = x2.shape[0]
        upcast = upcast_loads(x.dtype, interpret) or upcast_loads(weight.dtype, interpret)
        if residual is None:
            if rows:
                rms_norm_kernel[(rows,)](
                    out,
                    out,
                    x2,
                    x2,
                    weight,
                    x2.stride(0),
                    0,
                    out.stride(0),
                    0,
                    hidden_size,
                    eps,
                    HAS_RESIDUAL=False,
                    UPCAST=upcast,
                    BLOCK_N=block,
                    **launch,
                )
            return out.view(shape)
        r2 = row_view(residual, hidden_size)
        summed = torch.empty(x2.shape, dtype=torch.result_type(x, residual), device=x.device)
        if rows:
            rms_norm_kernel[(rows,)](
                out,
                summed,
                x2,
                r2,
                weight,
                x2.stride(0),
                r2.stride(0),
                out.stride(0),
                summed.stride(0),
                hidden_size,
                eps,
                HAS_RESIDUAL=True,
                UPCAST=upcast or upcast_loads(residual.dtype, interpret),
                BLOCK_N=block,
                **launch,
            )
        return out.view(shape), summed.view(shape)

    return rms_norm
