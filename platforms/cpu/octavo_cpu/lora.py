"""Batched multi-LoRA products on the host CPU: the compiled kernels (csrc/lora.cpp) when they are
built, each segment of a step's tokens against its slot's adapter in one pass; else None, and
the LoRA layers use the reference (``octavo.ops.reference.lora_shrink`` / ``lora_expand``).

The kernels take float32 and bfloat16 models; a call with tensors of another dtype than the
model's (or a buffer not in float32) goes to the reference, with the same numbers up to float32
summation order.
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
    return CompiledLoRAKernels(dtype, ops)


class CompiledLoRAKernels:
    """``shrink`` and ``expand`` through the compiled ops for a ``dtype`` model; tensors of
    another dtype go to the reference. The ops take strided rows as they are and copy what is
    not contiguous within a row (the checks here are the few that decide between the two: each
    costs a decode step's kernel some 5%)."""

    __slots__ = ("_dtype", "_shrink", "_expand")

    def __init__(self, dtype: torch.dtype, ops: Any):
        self._dtype = dtype
        self._shrink = ops.lora_shrink.default
        self._expand = ops.lora_expand.default

    def shrink(
        self, x: torch.Tensor, a_stacked: torch.Tensor, mapping: LoRAMapping
    ) -> torch.Tensor:
        if x.dtype is not self._dtype or a_stacked.dtype is not self._dtype:
            return reference.lora_shrink(x, a_stacked, mapping)
        return self._shrink(
            x,
            a_stacked,
            mapping.token_slots,
            mapping.sorted_tokens,
            mapping.segment_slots,
            mapping.segment_starts,
        )

    def expand(
        self,
        y: torch.Tensor,
        buffer: torch.Tensor,
        b_stacked: torch.Tensor,
        mapping: LoRAMapping,
        offset: int,
    ) -> None:
        dtype = self._dtype
        if y.dtype is not dtype or b_stacked.dtype is not dtype or buffer.dtype is not _FLOAT:
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


_FLOAT = torch.float32


@functools.lru_cache(maxsize=None)
def _register_fakes(namespace: str) -> None:
    """Fake (meta) implementations of the two ops, as octavo_cpu.fake_ops gives the others, so
        that torch.compile traces through them: the shrink returns a new tensor, the expand writes
    in place and returns nothing."""

    @torch.library.register_fake(f"{namespace}::lora_shrink")
    def _lora_shrink(x, a_stacked, token_slots, sorted_tokens, segment_slots, starts):
        return x.new_empty((x.shape[0], a_stacked.shape[1]), dtype=torch.float32)

    @torch.library.register_fake(f"{namespace}::lora_expand")
    def _lora_expand(y, buffer, b_stacked, sorted_tokens, segment_slots, starts, offset):
        return None
