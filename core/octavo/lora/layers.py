"""LoRA on the base model's projections: each adapted linear layer adds, after its own product,
every token's ``(x A) B`` from its slot through the platform's ``LoRAKernels``.

The layer keeps its product (packed, quantised or ``F.linear``); LoRA wraps it as the layer's
``quant_method``, so every way a layer is called (whole, by part for gate/up, fused q/k/v)
gets its parts' deltas. The slots' weights are stacked per part: ``a [S, R, in]`` and
``b [S, out, R]`` with the scaling folded into ``b`` and lower ranks zero-padded. The step's
:class:`~octavo.platform.types.LoRAMapping` is set once on the shared :class:`LoRAStep`; while
it is None (no token has an adapter) the layers run exactly as without LoRA.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from octavo.errors import ConfigError
from octavo.models.layers.linear import ColumnParallelLinear, QuantMethod
from octavo.platform.types import LoRAKernels, LoRAMapping


@dataclasses.dataclass
class LoRAStep:
    """The step's token -> slot mapping, shared by every LoRA layer (None: no adapter)."""

    mapping: Optional[LoRAMapping] = None


@dataclasses.dataclass(frozen=True)
class LoRAPart:
    """One adapted projection inside a linear layer: output columns ``offset .. offset+size``
    of the layer, the checkpoint module it stands for, and its slots' stacked weights."""

    module: str
    offset: int
    size: int
    a: torch.Tensor  # [S, R, in]
    b: torch.Tensor  # [S, out, R]


class LoRAMatmul:
    """A linear layer's product plus its parts' LoRA deltas (a ``QuantMethod``)."""

    def __init__(
        self,
        inner: Optional[QuantMethod],
        parts: list[LoRAPart],
        step: LoRAStep,
        kernels: LoRAKernels,
    ):
        self.inner, self.parts, self.step, self.kernels = inner, parts, step, kernels

    def apply(
        self, layer: nn.Module, x: torch.Tensor, start: int, size: int, bias: Optional[torch.Tensor]
    ) -> torch.Tensor:
        if self.inner is not None:
            out = self.inner.apply(layer, x, start, size, bias)
        else:
            out = F.linear(x, layer.weight.narrow(0, start, size), bias)
        mapping = self.step.mapping
        if mapping is None:
            return out
        kernels = self.kernels
        for part in self.parts:
            if start <= part.offset and part.offset + part.size <= start + size:
                shrunk = kernels.shrink(x, part.a, mapping)
                kernels.expand(out, shrunk, part.b, mapping, part.offset - start)
        return out


# (attribute path in a decoder layer, the checkpoint modules it holds, in output order)
LLAMA_PROJECTIONS = (
    ("self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj")),
    ("self_attn.o_proj", ("o_proj",)),
    ("mlp.gate_up_proj", ("gate_proj", "up_proj")),
    ("mlp.down_proj", ("down_proj",)),
)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers LoRA adapts (the Llama family's ``model.layers``)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or not all(_has_projections(layer) for layer in layers):
        raise ConfigError(
            f"--enable-lora supports models of the Llama family (Llama, Mistral, Qwen2, Qwen3); "
            f"{type(model).__name__} has no such decoder layers"
        )
    return layers


def _has_projections(layer: nn.Module) -> bool:
    return all(_module(layer, path) is not None for path, _ in LLAMA_PROJECTIONS)


def _module(layer: nn.Module, path: str) -> Optional[nn.Module]:
    for name in path.split("."):
        layer = getattr(layer, name, None)
    return layer


def _layer_parts(linear: nn.Module, modules: tuple[str, ...], shapes, num_slots, rank, dtype):
    """The parts of one linear layer, their slot weights (in the activations' ``dtype``: a
    quantised layer's weight is raw rows) zeroed on the layer's device."""
    if isinstance(linear, ColumnParallelLinear):
        offsets, sizes = linear.shard_offsets, linear.shard_sizes
    else:  # row-parallel: one part, all its outputs
        offsets, sizes = (0,), (linear.output_size,)
    device = linear.weight.device
    parts = []
    for module, offset, size in zip(modules, offsets, sizes):
        size_in, size_out = shapes[module]
        assert size == size_out, f"{module}: {size} rows but the config implies {size_out}"
        a = torch.zeros(num_slots, rank, size_in, dtype=dtype, device=device)
        b = torch.zeros(num_slots, size_out, rank, dtype=dtype, device=device)
        parts.append(LoRAPart(module, offset, size, a, b))
    return parts


def attach_lora(
    model: nn.Module,
    shapes,
    num_slots: int,
    rank: int,
    kernels: LoRAKernels,
    dtype: torch.dtype,
) -> tuple[LoRAStep, list[dict[str, LoRAPart]]]:
    """Wrap every adaptable projection of ``model`` (``shapes``: module -> (in, out)) with
    :class:`LoRAMatmul` over ``num_slots`` slots of ``rank`` in ``dtype`` (the model's);
    returns the shared step and, per decoder layer, its parts by checkpoint module name."""
    step = LoRAStep()
    per_layer: list[dict[str, LoRAPart]] = []
    for layer in decoder_layers(model):
        parts_by_module: dict[str, LoRAPart] = {}
        for path, modules in LLAMA_PROJECTIONS:
            linear = _module(layer, path)
            parts = _layer_parts(linear, modules, shapes, num_slots, rank, dtype)
            linear.quant_method = LoRAMatmul(linear.quant_method, parts, step, kernels)
            parts_by_module.update((part.module, part) for part in parts)
        per_layer.append(parts_by_module)
    return step, per_layer
