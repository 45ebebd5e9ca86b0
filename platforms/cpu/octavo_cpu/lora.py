"""Batched multi-LoRA products on the host CPU: the compiled kernels (csrc/lora.cpp) when they are
built, each segment of a step's tokens against its slot's adapter in one pass; else None, and
the LoRA layers use the reference (``octavo.ops.reference.lora_shrink`` / ``lora_expand``).

The kernels take float32 and bfloat16 models; a call they cannot take as it is (another dtype,
a tensor whose rows are not contiguous) goes to the reference, with the same numbers up to
float32 summation order.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch

from octavo.ops import reference
from octavo.platform.types import LoRAKernels, LoRAMapping

DTYPES = (torch.float32, torch.bfloat16)


def make_lora_kernels(dtype: torch.dtype, ops: Any) -> Optional[LoRAKernels]:
    """The :class:`LoRAKernels` of a ``dtype`` model over the loaded library's ``ops`` (see
    octavo_cpu.kernels), or None: no library, one built before these kernels, or a dtype the
    kernels do not take."""
    if ops is None or not hasattr(ops, "lora_shrink") or dtype not in DTYPES:
        return None
    _register_fakes(ops.name)
    return CompiledLoRAKernels(ops)


class CompiledLoRAKernels:
    """``shrink`` and ``expand`` through the compiled ops, the reference for what they refuse."""

    __slots__ = ("_shrink", "_expand")

    def __init__(self, ops: Any):
        self._shrink = ops.lora_shrink.default
        self._expand = ops.lora_expand.default

    def shrink(
        self, x: torch.Tensor, a_stacked: torch.Tensor, mapping: LoRAMapping
    ) -> torch.Tensor:
        if not _fits(x, a_stacked) or x.dim() != 2 or x.stride(1) != 1:
            return reference.lora_shrink(x, a_stacked, mapping)
        out = torch.empty(x.shape[0], a_stacked.shape[1], dtype=torch.float32)
        self._shrink(
            out,
            x,
            a_stacked,
            mapping.token_slots,
            mapping.sorted_tokens,
            mapping.segment_slots,
            mapping.segment_starts,
        )
        return out

    def expand(
        self,
        y: torch.Tensor,
        buffer: torch.Tensor,
        b_stacked: torch.Tensor,
        mapping: LoRAMapping,
        offset: int,
    ) -> None:
        fits = _fits(y, b_stacked) and y.dim() == 2 and y.stride(1) == 1
        if not fits or buffer.dtype != torch.float32 or buffer.stride(-1) != 1:
            reference.lora_expand(y, buffer, b_stacked, mapping, offset)
            return
        self._expand(
            y,
            buffer,
            b_stacked,
            mapping.sorted_tokens,
            mapping.segment_slots,
            mapping.segment_starts,
            offset,
        )


def _fits(activations: torch.Tensor, weights: torch.Tensor) -> bool:
    """Whether the compiled ops take these: the kernels' dtypes, one for both, packed weights,
    on the host."""
    return (
        activations.dtype in DTYPES
        and weights.dtype == activations.dtype
        and weights.is_contiguous()
        and activations.device.type == "cpu"
    )


@functools.lru_cache(maxsize=None)
def _register_fakes(namespace: str) -> None:
    """Fake (meta) implementations of the two ops, as octavo_cpu.fake_ops gives the others, so
    that torch.compile traces through them: both write in place and return nothing."""

    @torch.library.register_fake(f"{namespace}::lora_shrink")
    def _lora_shrink(out, x, a_stacked, token_slots, sorted_tokens, segment_slots, starts):
        return None

    @torch.library.register_fake(f"{namespace}::lora_expand")
    def _lora_expand(y, buffer, b_stacked, sorted_tokens, segment_slots, starts, offset):
        return None
