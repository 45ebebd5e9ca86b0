"""RMSNorm on the host CPU, with the residual add fused in front.

float32 uses torch's native ``rms_norm`` (bit-for-bit HuggingFace's result). Lower precisions
follow HuggingFace's rounding exactly (statistics in float32, the normalised value rounded to
the input dtype before the weight multiplies it) with in-place steps on the one float32 copy.
Inputs are never modified; with a residual the sum is the second output.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def make_rms_norm(hidden_size: int, eps: float, dtype: torch.dtype):
    """``fn(x, weight, residual=None)`` for one hidden size, eps and dtype."""
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
