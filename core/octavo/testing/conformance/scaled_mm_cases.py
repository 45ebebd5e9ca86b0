"""FP8 scaled-matmul operands as ``--quantization fp8`` produces them.

The FP8 linear layer (``octavo.models.layers.fp8``) quantises its input per token and its weight
per output channel to ``float8_e4m3fn`` and calls ``scaled_mm(x8, W8.t(), scale_x, scale_w)``:
``b`` is the transpose of a row-major ``[N, K]`` weight, not a contiguous ``[K, N]`` tensor.
The kernel contract also allows per-tensor scales on either side; every combination is built.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

FP8_DTYPE = torch.float8_e4m3fn

SHAPES = ((1, 16, 16), (5, 40, 24), (33, 96, 17))
"""``(M, K, N)``: one token, then sizes that leave ragged tiles on every side."""

SCALES = ("tensor x tensor", "token x channel", "tensor x channel", "token x tensor")
"""``scale_a`` per tensor ``[1]`` or per token ``[M, 1]``, times ``scale_b`` per tensor ``[1]``
or per channel ``[1, N]``."""


@dataclasses.dataclass(frozen=True)
class ScaledMMOperands:
    """One call's host arguments: ``scaled_mm(a, b, scale_a, scale_b, out_dtype, bias)``."""

    a: torch.Tensor  # [M, K] float8_e4m3fn
    b: torch.Tensor  # [K, N] float8_e4m3fn (a transposed weight unless contiguous was asked)
    scale_a: torch.Tensor  # [1] or [M, 1] float32
    scale_b: torch.Tensor  # [1] or [1, N] float32
    bias: Optional[torch.Tensor]  # [N] in the output dtype, or None

    def to(self, device: torch.device) -> "ScaledMMOperands":
        """The same operands on ``device``, ``b``'s layout kept."""
        b = self.b.t().to(device).t() if not self.b.is_contiguous() else self.b.to(device)
        return ScaledMMOperands(
            self.a.to(device),
            b,
            self.scale_a.to(device),
            self.scale_b.to(device),
            None if self.bias is None else self.bias.to(device),
        )


def make_operands(
    shape: tuple[int, int, int],
    scales: str,
    out_dtype: torch.dtype,
    with_bias: bool,
    transposed_weight: bool = True,
    seed: int = 0,
) -> ScaledMMOperands:
    """Spread-out FP8 operands (values up to ~16, some subnormal) with positive scales."""
    m, k, n = shape
    generator = torch.Generator().manual_seed(seed)
    a = (torch.randn(m, k, generator=generator) * 4).to(FP8_DTYPE)
    weight = (torch.randn(n, k, generator=generator) * 4).to(FP8_DTYPE)
    b = weight.t() if transposed_weight else weight.t().contiguous()
    per_a, per_b = scales.split(" x ")
    scale_a = torch.tensor([0.02])
    if per_a == "token":
        scale_a = torch.rand(m, 1, generator=generator) / 10
    scale_b = torch.tensor([0.5])
    if per_b == "channel":
        scale_b = torch.rand(1, n, generator=generator) + 0.05
    bias = torch.randn(n, generator=generator).to(out_dtype) if with_bias else None
    return ScaledMMOperands(a, b, scale_a, scale_b, bias)
