"""Loading checkpoint tensors into a model whose layers fuse some of them (qkv, gate_up).

A model describes its fusions as ``(param_fragment, checkpoint_fragment, shard_id)`` triples,
e.g. ``(".qkv_proj.", ".q_proj.", "q")``; each parameter's own ``weight_loader`` places a
checkpoint tensor (and, under tensor parallelism, takes only its rank's slice).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, Sequence, Union

import torch
from torch import nn

from octavo.errors import ConfigError
from octavo.models.layers.linear import default_weight_loader

logger = logging.getLogger(__name__)

StackedParams = Sequence[tuple[str, str, Any]]


class CheckpointTensor:
    """A checkpoint tensor not read yet: ``shape`` and ``narrow(dim, start, length)``, which
    reads only that slice from the file (safetensors ``get_slice``), so a tensor-parallel rank
    reads its shard and no more. ``elements_read`` counts what was read."""

    def __init__(self, tensor_slice: Any):
        self._slice = tensor_slice
        self.shape = torch.Size(tensor_slice.get_shape())
        self.elements_read = 0

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(start, start + length)
        out = self._slice[tuple(index)]
        self.elements_read += out.numel()
        return out


LoadedTensor = Union[torch.Tensor, CheckpointTensor]


def load_checkpoint_tensors(
    model: nn.Module,
    weights: Iterable[tuple[str, LoadedTensor]],
    stacked: StackedParams,
    skip: Callable[[str], bool] = lambda name: False,
) -> set[str]:
    """Load ``(checkpoint name, tensor)`` pairs into ``model``; return the names consumed.

    A tensor of the wrong shape raises ConfigError naming it; tensors the model has no place
    for are logged and ignored.
    """
    params = dict(model.named_parameters())
    consumed: set[str] = set()
    unexpected: list[str] = []
    for name, tensor in weights:
        if skip(name):
            continue
        target, shard_id = name, None
        for param_fragment, checkpoint_fragment, shard in stacked:
            if checkpoint_fragment in name:
                target, shard_id = name.replace(checkpoint_fragment, param_fragment), shard
                break
        param = params.get(target)
        if param is None:
            unexpected.append(name)
            continue
        loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            loader(param, tensor, shard_id)
        except ValueError as exc:
            raise ConfigError(f"checkpoint tensor {name!r} {exc}") from None
        consumed.add(name)
    if unexpected:
        logger.warning(
            "ignored %d checkpoint tensors the model does not use: %s",
            len(unexpected),
            unexpected[:8],
        )
    return consumed


def expected_checkpoint_names(model: nn.Module, stacked: StackedParams) -> set[str]:
    """The checkpoint tensor names that ``model``'s parameters need (fusions expanded)."""
    names: set[str] = set()
    for param_name, _ in model.named_parameters():
        fused = [(p, c) for p, c, _ in stacked if p in param_name]
        if not fused:
            names.add(param_name)
        names.update(param_name.replace(p, c) for p, c in fused)
    return names
