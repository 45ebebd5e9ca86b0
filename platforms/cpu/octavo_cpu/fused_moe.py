"""Mixture-of-Experts layers on the host CPU: the routing in torch
(``octavo.ops.reference.select_experts``), then the experts in one compiled call
(csrc/fused_moe.cpp): the step's tokens grouped by expert, each used expert's gate/up and down
products by the platform's GEMM over its weights packed once at load, silu(gate) * up between
them, and each token's weighted sum of its experts in ascending expert order (the reference's
roundings, op by op: a token's output does not depend on the other tokens of the step).

float32 and bfloat16 models with the SiLU activation; anything else (no compiled library, one
built before this kernel, another dtype) gets None, and the reference serves. A call the
kernel does not take (hidden states in another dtype than the model's, or whose columns are not
contiguous) goes to the reference too.

The packed copy is the GEMM's layout (column panels, ``pack_linear_weight``), stacked per
expert: as much memory again as the layer's expert weights, which the model keeps (as it keeps
its dense layers' weights beside their packed copies).
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch

from octavo.ops import reference
from octavo.platform.types import FusedMoEPacker, MoESpec

DTYPES = (torch.float32, torch.bfloat16)


def make_fused_moe(spec: MoESpec, ops: Any) -> Optional[FusedMoEPacker]:
    """The packer of ``spec``'s layers over the loaded library's ``ops`` (see
    octavo_cpu.kernels), or None: no library, one built before this kernel, or a dtype or
    activation the kernel does not take."""
    if ops is None or not hasattr(ops, "fused_moe") or spec.dtype not in DTYPES:
        return None
    if spec.activation != "silu":
        return None
    _register_fakes(ops.name)
    return functools.partial(CompiledFusedMoE, spec, ops)


class CompiledFusedMoE:
    """One layer's experts packed for the compiled op (``FusedMoEFn``): ``pack(w13, w2)``."""

    __slots__ = ("spec", "w13_packed", "w2_packed", "_w13", "_w2", "_op")

    def __init__(self, spec: MoESpec, ops: Any, w13: torch.Tensor, w2: torch.Tensor):
        experts, inner, hidden = spec.num_experts, spec.intermediate_size, spec.hidden_size
        want13, want2 = (experts, 2 * inner, hidden), (experts, hidden, inner)
        if tuple(w13.shape) != want13 or tuple(w2.shape) != want2:
            raise ValueError(
                f"fused MoE weights w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not "
                f"match the layer's {want13} and {want2}"
            )
        bf16 = spec.dtype == torch.bfloat16
        pack_weight = ops.pack_linear_weight_bf16 if bf16 else ops.pack_linear_weight
        self.spec = spec
        self.w13_packed = pack_stacked(pack_weight, w13)
        self.w2_packed = pack_stacked(pack_weight, w2)
        self._w13, self._w2 = w13, w2  # for a call the kernel does not take (the reference's)
        self._op = ops.fused_moe.default  # the overload itself: the packet's lookup costs ~1 us

    def __call__(
        self,
        hidden: torch.Tensor,
        router_logits: torch.Tensor,
        correction_bias: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        spec = self.spec
        if hidden.dtype is not spec.dtype or hidden.dim() != 2 or hidden.stride(-1) != 1:
            return reference.fused_moe(
                hidden, router_logits, self._w13, self._w2, spec, correction_bias
            )
        weights, ids = reference.select_experts(router_logits, spec, correction_bias)
        out = torch.empty_like(hidden, memory_format=torch.contiguous_format)
        self._op(
            out, hidden, weights.contiguous(), ids.contiguous(), self.w13_packed, self.w2_packed
        )
        return out


def pack_stacked(pack_weight: Any, stacked: torch.Tensor) -> torch.Tensor:
    """``[E, P, K, NR]``: each ``stacked[e]`` (``[N, K]``) packed by ``pack_weight``, into one
    tensor (a packed expert at a time beside it, not all of them twice)."""
    first = pack_weight(stacked[0])
    packed = first.new_empty((stacked.shape[0], *first.shape))
    packed[0] = first
    for expert in range(1, stacked.shape[0]):
        packed[expert] = pack_weight(stacked[expert])
    return packed


@functools.lru_cache(maxsize=None)
def _register_fakes(namespace: str) -> None:
    """The op's fake (meta) implementation, as octavo_cpu.fake_ops gives the others, so that
    torch.compile traces through it: it writes ``out`` in place and returns nothing."""

    @torch.library.register_fake(f"{namespace}::fused_moe")
    def _fused_moe(out, hidden, topk_weights, topk_ids, w13_packed, w2_packed):
        return None
