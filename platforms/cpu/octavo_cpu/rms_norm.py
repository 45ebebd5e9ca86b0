"""RMSNorm on the host CPU, with the residual add fused in front: the compiled kernel
(csrc/rms_norm.cpp, one pass for the sum and its statistics) when it is built, else torch ops.

On the torch path, float32 uses torch's native ``rms_norm`` (bit-for-bit HuggingFace's result);
lower precisions follow HuggingFace's rounding exactly (statistics in float32, the normalised
value rounded to the input dtype before the weight multiplies it) with in-place steps on the one
float32 copy. The compiled kernel rounds the same way; its float32 sums differ from torch's by
summation order only.
Inputs are never modified; with a residual the sum is the second output.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def make_rms_norm(hidden_size: int, eps: float, dtype: torch.dtype, ops=None):
    """``fn(x, weight, residual=None)`` for one hidden size, eps and dtype: the compiled kernel
    (``ops``: the loaded library's ops, see octavo_cpu.kernels) for 2-D contiguous inputs whose
    weight shares their dtype, else the torch ops below."""
    torch_rms_norm = _make_torch_rms_norm(hidden_size, eps)
    if ops is None:
        return torch_rms_norm

    def rms_norm(x: torch.Tensor, weight: torch.Tensor, residual: Optional[torch.Tensor] = None):
        fits = x.dim() == 2 and x.is_contiguous() and weight.dtype == x.dtype
        if not fits or (residual is not None and not residual.is_contiguous()):
            return torch_rms_norm(x, weight, residual)
        out = torch.empty_like(x)
        if residual is None:
            ops.rms_norm(out, x, weight, eps)
            return out
        summed = torch.empty_like(x)
        ops.fused_add_rms_norm(out, summed, x, residual, weight, eps)
        return out, summed

    return rms_norm


def _make_torch_rms_norm(hidden_size: int, eps: float):
    shape = (hidden_size,)

    def normalise(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and weight.dtype == torch.float32:
            return F.rms_norm(x, shape, weight, eps)
        h = x.float()
        variance = h.square().mean(-1, keepdim=True)
        h = h.mul_(variance.add_(eps).rsqrt_()).to(x.dtype)
        # HuggingFace multiplies in the promoted dtype when the weight's differs from x's.
        return h.mul_(weight) if weight.dtype == x.dtype else weight * h

    def rms_norm(x: torch.Tensor, weight: torch.Tensor, residual: Optional[torch.Tensor] = None):
        if residual is None:
            return normalise(x, weight)
        summed = torch.add(x, residual)
        return normalise(summed, weight), summed

    return rms_norm
