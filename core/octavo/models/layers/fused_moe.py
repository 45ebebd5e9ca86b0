"""A Mixture-of-Experts layer: the router's linear, then the platform's fused MoE over expert
weights stacked at load (``Platform.fused_moe``; the oracle ``octavo.ops.reference.fused_moe``).

Checkpoints hold one tensor per expert and projection (``experts.{e}.gate_proj.weight``, ...);
:func:`expert_stacked_params` maps them onto the stacked parameters, whose ``weight_loader``
takes the expert and projection as ``shard_id``. Under tensor parallelism each expert's inner
width is split across ranks, as vLLM splits it: ``gate``/``up`` rows and ``down`` columns, the
partial outputs all-reduced. Expert parallelism is not built (``--enable-expert-parallel`` is
refused).
"""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import nn

from octavo.models.layers.linear import ColumnParallelLinear, TPGroup, check_shape
from octavo.ops import reference
from octavo.platform.facade import Platform
from octavo.platform.types import FusedMoEFn, MoESpec

GATE, UP, DOWN = 0, 1, 2


def expert_stacked_params(
    num_experts: int,
    projections: tuple[str, str, str],
    checkpoint_block: str = ".mlp.",
) -> tuple[tuple[str, str, tuple[int, int]], ...]:
    """``(param fragment, checkpoint fragment, (expert, part))`` triples for
    ``octavo.models.weights.load_checkpoint_tensors``: expert ``e``'s gate, up and down
    tensors (named ``projections``, e.g. ``("gate_proj", "up_proj", "down_proj")`` or
    Mixtral's ``("w1", "w3", "w2")``, in a block named ``checkpoint_block``: Mixtral's is
    ``.block_sparse_moe.``) onto the ``.mlp.experts.`` layer's ``w13_weight`` and
    ``w2_weight``."""
    triples = []
    for e in range(num_experts):
        for part, name in zip((GATE, UP, DOWN), projections):
            param = ".mlp.experts.w2_weight" if part == DOWN else ".mlp.experts.w13_weight"
            triples.append((param, f"{checkpoint_block}experts.{e}.{name}.weight", (e, part)))
    return tuple(triples)


class FusedExperts(nn.Module):
    """The stacked expert weights of one layer and the platform's fused MoE over them.

    ``w13_weight [E, 2 * I_rank, H]``: each expert's gate rows, then its up rows (this rank's
    share of each); ``w2_weight [E, H, I_rank]``: its down projection's columns.
    """

    def __init__(
        self,
        spec: MoESpec,
        *,
        device: Union[str, torch.device],
        tp: TPGroup,
    ):
        super().__init__()
        self.tp = tp
        self.full_intermediate = spec.intermediate_size * tp.size
        self.spec = spec
        experts, hidden, inner = spec.num_experts, spec.hidden_size, spec.intermediate_size
        kw = dict(dtype=spec.dtype, device=device)
        self.w13_weight = nn.Parameter(torch.empty(experts, 2 * inner, hidden, **kw), False)
        self.w2_weight = nn.Parameter(torch.empty(experts, hidden, inner, **kw), False)
        for param in (self.w13_weight, self.w2_weight):
            param.weight_loader = self.weight_loader
        self._fn: FusedMoEFn = reference.pack_fused_moe(spec, self.w13_weight, self.w2_weight)

    def weight_loader(self, param: torch.Tensor, loaded, shard_id: tuple[int, int]) -> None:
        """Load expert ``shard_id[0]``'s projection ``shard_id[1]`` (GATE, UP or DOWN), keeping
        this rank's rows (gate, up) or columns (down) of its inner width."""
        expert, part = shard_id
        hidden, inner = self.spec.hidden_size, self.spec.intermediate_size
        start = self.tp.rank * inner
        if part == DOWN:
            check_shape(loaded, (hidden, self.full_intermediate))
            param.data[expert].copy_(loaded.narrow(1, start, inner))
        else:
            check_shape(loaded, (self.full_intermediate, hidden))
            rows = param.data[expert].narrow(0, part * inner, inner)
            rows.copy_(loaded.narrow(0, start, inner))

    def pack(self, platform: Platform) -> None:
        """Hand the loaded weights to the platform's fused MoE (once, after loading)."""
        self._fn = platform.fused_moe(self.spec)(self.w13_weight.detach(), self.w2_weight.detach())

    def forward(
        self,
        hidden: torch.Tensor,
        router_logits: torch.Tensor,
        correction_bias: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        out = self._fn(hidden, router_logits, correction_bias)
        return out if self.tp.size == 1 else self.tp.communicator.all_reduce(out)


class SparseMoeBlock(nn.Module):
    """A router (``gate``, replicated on every rank) and its experts: Mixtral's and Qwen3-MoE's
    block (HF names: ``gate.weight`` and ``experts.{e}.*``)."""

    def __init__(self, spec: MoESpec, *, device: Union[str, torch.device], tp: TPGroup):
        super().__init__()
        experts = spec.num_experts
        self.gate = ColumnParallelLinear(
            spec.hidden_size,
            (experts,),
            False,
            dtype=spec.dtype,
            device=device,
            tp=tp,
            shards=((0, experts),),
        )
        self.experts = FusedExperts(spec, device=device, tp=tp)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden, self.gate(hidden))


@torch.inference_mode()
def pack_experts(model: nn.Module, platform: Platform) -> nn.Module:
    """Give every MoE layer of ``model`` the platform's fused MoE over its loaded weights."""
    for module in model.modules():
        if isinstance(module, FusedExperts):
            module.pack(platform)
    return model
