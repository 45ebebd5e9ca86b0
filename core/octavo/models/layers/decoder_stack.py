"""Decoder layers and their final norm, run by the platform in one call where it offers one
(``octavo_decoder_stack``): the same numbers as the modules, without the interpreter between a
layer's dozen kernels (on the cpu platform half of a small model's one-token step)."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

DecoderStackFn = Callable[[torch.Tensor, Any, Any], torch.Tensor]
"""``fn(hidden [T, hidden], cos_sin, attn_metadata) -> hidden``: the layers, then the norm."""


class StackedDecoder:
    """A module's ``layers`` (Llama decoder layers) and ``norm``, run by :meth:`run_layers`."""

    layers: nn.ModuleList
    norm: nn.Module
    decoder_stack: Optional[DecoderStackFn] = None  # set by attach_decoder_stacks

    def run_layers(self, hidden: torch.Tensor, cos_sin, attn_metadata) -> torch.Tensor:
        """The layers and the final norm over ``hidden``: the platform's stack when it has
        one, except under a dispatch mode (the start-up profile run's memory counter), which
        sees the ops dispatched from Python, so the modules' allocations, not the stack's."""
        if self.decoder_stack is not None and not is_in_torch_dispatch_mode():
            return self.decoder_stack(hidden, cos_sin, attn_metadata)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, cos_sin, attn_metadata)
        hidden, _ = self.norm(hidden, residual)
        return hidden


def attach_decoder_stacks(model: nn.Module, platform: Any) -> nn.Module:
    """Give every :class:`StackedDecoder` in ``model`` the platform's stack of its layers (None
    where the platform has none for them). Called after the linears are packed."""
    for module in model.modules():
        if isinstance(module, StackedDecoder):
            module.decoder_stack = platform.decoder_stack(module.layers, module.norm)
    return model
