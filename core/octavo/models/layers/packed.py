"""Linear layers multiplied by the platform's own GEMM over weights it packed once, at load.

A platform that offers ``octavo_linear_packer`` for the model's dtype (the cpu platform: its
compiled GEMM over column panels, or oneDNN's blocked layout) gets each weight once, after
loading; every product then calls the packed function instead of ``F.linear``. Quantised layers
are left alone. Widened layers (:mod:`octavo.models.layers.widen`: float32 weights of a
low-precision model), and every layer of a packer marked ``takes_float32`` (a GEMM that
multiplies a low-precision model's weights in float32), keep the widened arithmetic: the
product in float32, the bias added in float32, the result rounded to the activations' dtype.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from octavo.models.layers.embedding import ParallelLMHead
from octavo.models.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    RowParallelLinear,
)
from octavo.models.layers.widen import WidenedMatmul
from octavo.platform.types import LinearPacker

Product = Callable[[torch.Tensor], torch.Tensor]


class PackedMatmul:
    """A linear layer's ``QuantMethod`` over packed copies of its weight's row ranges."""

    def __init__(self, layer: nn.Module, pack: LinearPacker) -> None:
        self._pack = pack
        # The product takes float32 rows: float32 weights, or a packer that widens in registers.
        self.widened = isinstance(layer.quant_method, WidenedMatmul) or getattr(
            pack, "takes_float32", False
        )
        self._products: dict[tuple[int, int], Product] = {}
        weight = layer.weight.detach()
        ranges = [(0, weight.shape[0])]
        if isinstance(layer, MergedColumnParallelLinear):
            ranges = list(zip(layer.shard_offsets, layer.shard_sizes))
        for start, size in ranges:
            self._products[(start, size)] = pack(weight.narrow(0, start, size))

    def product_for(self, start: int, size: int) -> Optional[Product]:
        """The packed product of the weight's rows ``start .. start + size`` (None: not packed
        yet)."""
        return self._products.get((start, size))

    def apply(
        self, layer: nn.Module, x: torch.Tensor, start: int, size: int, bias: Optional[torch.Tensor]
    ) -> torch.Tensor:
        product = self._products.get((start, size))
        if product is None:  # a row range not packed at load: pack it once now
            product = self._pack(layer.weight.detach().narrow(0, start, size))
            self._products[(start, size)] = product
        if self.widened:
            out = product(x.float())
            return (out if bias is None else out + bias).to(x.dtype)
        out = product(x)
        return out if bias is None else out + bias


@torch.inference_mode()
def pack_linears(model: nn.Module, pack: Optional[LinearPacker]) -> nn.Module:
    """Give every unquantised linear layer of ``model`` (and its LM head) the platform's packed
    product; ``pack`` None leaves the model as it is."""
    if pack is None:
        return model
    for layer in model.modules():
        linear = isinstance(layer, (ColumnParallelLinear, RowParallelLinear))
        if linear and (layer.quant_method is None or isinstance(layer.quant_method, WidenedMatmul)):
            layer.quant_method = PackedMatmul(layer, pack)
        elif isinstance(layer, ParallelLMHead) and layer.packed is None:  # not kept quantized
            weight = layer.weight if layer.widened_weight is None else layer.widened_weight
            layer.packed = pack(weight.detach())
    return model
