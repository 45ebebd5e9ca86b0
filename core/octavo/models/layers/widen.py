"""Linear layers of a low-precision model multiplied in float32, for hosts without native
low-precision matmul.

A bfloat16 product ``x @ W^T`` is computed by every fast kernel as exact products summed in
float32 and rounded once to bfloat16. On CPUs without AVX512-BF16 or AMX, torch's bfloat16
matmul emulates that several times slower than its float32 matmul does the same arithmetic.
Widening the weights to float32 once, at load (the same values: bfloat16 and float16 widen
exactly), and rounding each product back to the activations' dtype gives the same numbers,
up to float32 summation order, at float32 speed; the price is twice the weight memory.

The platform asks for it through ``Capabilities.widened_matmul_dtypes``. Embeddings, norms
and the KV cache keep the model's dtype; the LM head keeps a widened copy of its (possibly
tied) weight and rounds its logits back like any other product.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from octavo.models.layers.embedding import ParallelLMHead
from octavo.models.layers.linear import ColumnParallelLinear, RowParallelLinear


class WidenedMatmul:
    """A linear layer's ``QuantMethod`` over its float32 weight: float32 product, output rounded
    to the activations' dtype."""

    def apply(
        self, layer: nn.Module, x: torch.Tensor, start: int, size: int, bias: Optional[torch.Tensor]
    ) -> torch.Tensor:
        weight = layer.weight
        if start != 0 or size != weight.shape[0]:
            weight = weight.narrow(0, start, size)
        return F.linear(x.float(), weight, bias).to(x.dtype)


@torch.inference_mode()
def widen_matmuls(model: nn.Module, dtypes: tuple[torch.dtype, ...]) -> nn.Module:
    """Widen the linear layers (and the LM head) of ``model`` when its dtype is in ``dtypes``.

    Layers that already delegate their products (a quantised layer) are left alone. Runs in
    inference mode like the loader, so the widened weights are inference tensors too.
    """
    head = next((m for m in model.modules() if isinstance(m, ParallelLMHead)), None)
    dtype = head.weight.dtype if head is not None else None
    if dtype is None or dtype not in dtypes:
        return model
    method = WidenedMatmul()
    for layer in model.modules():
        if (
            isinstance(layer, (ColumnParallelLinear, RowParallelLinear))
            and layer.quant_method is None
        ):
            layer.weight.data = layer.weight.data.float()
            if layer.bias is not None:
                layer.bias.data = layer.bias.data.float()
            layer.quant_method = method
    head.widen()
    return model
