"""``--quantization fp8``: the decoder's linear weights in FP8 (e4m3), activations quantised per
token.

At load time every column- and row-parallel linear layer (q/k/v/o, gate/up/down; embeddings
and the LM head are other classes and stay as they are) gets its weight replaced by
``float8_e4m3fn`` values with one float32 scale per output channel, ``W ~= W8 * scale[:, None]``.
At run time each product quantises its input per token (``x ~= x8 * scale_x`` row by row, the
scale from the row's absolute maximum) and calls the platform's ``scaled_mm`` kernel, resolved
once here, with per-token and per-channel scales.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from octavo.config import check_quantization
from octavo.errors import ConfigError
from octavo.models.layers.linear import ColumnParallelLinear, RowParallelLinear
from octavo.platform.facade import Platform
from octavo.platform.types import ScaledMMFn

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)
"""The smallest scale: an all-zero row (or channel) still gets a usable, finite one."""


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> ``(q [M, K] float8_e4m3fn, scale [M, 1] float32)``, ``x ~= q * scale``
    row by row: ``scale = max(amax(|row|) / 448, MIN_SCALE)``, ``q`` rounded to nearest."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


class Fp8Linear:
    """A linear layer's FP8 product: ``scaled_mm(x8, W8^T, scale_x, scale_w)``."""

    def __init__(self, scaled_mm: ScaledMMFn):
        self.scaled_mm = scaled_mm

    def apply(
        self, layer: nn.Module, x: torch.Tensor, start: int, size: int, bias: Optional[torch.Tensor]
    ):
        """``x @ W[start:start+size]^T (+ bias)`` in ``x.dtype``; leading dimensions are kept."""
        x2 = x.reshape(-1, x.shape[-1])
        q, scale_x = quantize_rows(x2)
        weight = layer.weight[start : start + size]  # [size, K] float8
        scale_w = layer.weight_scale[start : start + size].view(1, size)
        out = self.scaled_mm(q, weight.t(), scale_x, scale_w, x.dtype, bias)
        return out.view(*x.shape[:-1], size)


def quantize_linear_weight(layer: nn.Module, method: Fp8Linear) -> None:
    """Replace ``layer.weight`` by its FP8 values and add ``weight_scale [out]`` (float32)."""
    weight, scale = quantize_rows(layer.weight.data)
    layer.weight = nn.Parameter(weight, requires_grad=False)
    layer.register_buffer("weight_scale", scale.view(-1).contiguous(), persistent=False)
    layer.quant_method = method


def quantize_model(model: nn.Module, platform: Platform, quantization: Optional[str]) -> nn.Module:
    """Quantise ``model``'s linear layers as ``quantization`` says (None: leave it as it is).

    The platform must offer FP8 (``capabilities.supports_fp8``) and a ``scaled_mm`` kernel; the
    kernel is resolved once, here, and shared by every layer.
    """
    if check_quantization(quantization) is None:
        return model
    if not platform.capabilities.supports_fp8:
        raise ConfigError(
            f"platform {platform.name!r} has no FP8 kernels, so --quantization {quantization} "
            f"cannot run there; drop --quantization, or {platform.choose_another()} "
            "whose capabilities include FP8"
        )
    method = Fp8Linear(platform.scaled_mm())
    layers = [
        m for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))
    ]
    for layer in layers:
        quantize_linear_weight(layer, method)
    return model
