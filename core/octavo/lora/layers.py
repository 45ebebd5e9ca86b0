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
    of the layer, the checkpoint module it stands for, and its slots' stacked weights (``a``
    a view of the layer's ``a_stacked``: its ranks ``rank_offset ..``)."""

    module: str
    offset: int
    size: int
    rank_offset: int
    a: torch.Tensor  # [S, R, in]
    b: torch.Tensor  # [S, out, R]


class LoRAMatmul:
    """A linear layer's product plus its parts' LoRA deltas (a ``QuantMethod``).

    Every part of a layer reads the same input, so their A's are stacked along the rank
    (``a_stacked [S, P*R, in]``) and one shrink serves them all; each part's expand reads its
    columns of it. A merged layer called part by part (gate, then up, on the same ``x``) shrinks
    once, on its first part, and keeps the result for the others."""

    def __init__(
        self,
        inner: Optional[QuantMethod],
        parts: list[LoRAPart],
        a_stacked: torch.Tensor,
        step: LoRAStep,
        kernels: LoRAKernels,
    ):
        self.inner, self.parts, self.step, self.kernels = inner, parts, step, kernels
        self.a_stacked = a_stacked
        self.rank = parts[0].a.shape[1]
        self._shrunk: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # (x, x @ A^T)

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
        kernels, rank = self.kernels, self.rank
        shrunk = None
        for part in self.parts:
            if start <= part.offset and part.offset + part.size <= start + size:
                if shrunk is None:
                    shrunk = self._shrink(x, mapping, first=part is self.parts[0])
                ranks = shrunk[:, part.rank_offset : part.rank_offset + rank]
                kernels.expand(out, ranks, part.b, mapping, part.offset - start)
                if part is self.parts[-1]:
                    self._shrunk = None  # the layer's last part: nothing to keep
        return out

    def _shrink(self, x: torch.Tensor, mapping: LoRAMapping, first: bool) -> torch.Tensor:
        kept = self._shrunk
        if not first and kept is not None and kept[0] is x:
            return kept[1]
        shrunk = self.kernels.shrink(x, self.a_stacked, mapping)
        self._shrunk = (x, shrunk) if len(self.parts) > 1 else None
        return shrunk


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
    """The parts of one linear layer and their A's stacked along the rank, the slot weights (in
    the activations' ``dtype``: a quantised layer's weight is raw rows) zeroed on the layer's
    device."""
    if isinstance(linear, ColumnParallelLinear):
        offsets, sizes = linear.shard_offsets, linear.shard_sizes
    else:  # row-parallel: one part, all its outputs
        offsets, sizes = (0,), (linear.output_size,)
    device = linear.weight.device
    size_in = shapes[modules[0]][0]
    a_stacked = torch.zeros(num_slots, len(modules) * rank, size_in, dtype=dtype, device=device)
    parts = []
    for i, (module, offset, size) in enumerate(zip(modules, offsets, sizes)):
        part_in, size_out = shapes[module]
        assert size == size_out, f"{module}: {size} rows but the config implies {size_out}"
        assert part_in == size_in, f"{module}: the layer's parts read one input"
        a = a_stacked[:, i * rank : (i + 1) * rank]
        b = torch.zeros(num_slots, size_out, rank, dtype=dtype, device=device)
        parts.append(LoRAPart(module, offset, size, i * rank, a, b))
    return parts, a_stacked


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
            parts, a_stacked = _layer_parts(linear, modules, shapes, num_slots, rank, dtype)
            linear.quant_method = LoRAMatmul(linear.quant_method, parts, a_stacked, step, kernels)
            parts_by_module.update((part.module, part) for part in parts)
        per_layer.append(parts_by_module)
    return step, per_layer
