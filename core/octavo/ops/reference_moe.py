"""The Mixture-of-Experts oracle (re-exported by ``octavo.ops.reference``): routing, then a loop
over the experts the step's tokens chose, each op as HuggingFace's MoE blocks compute it."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from octavo.platform.types import FusedMoEFn, MoESpec


def select_experts(
    router_logits: torch.Tensor, spec: MoESpec, correction_bias: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights float32 [T, top_k], expert ids int64 [T, top_k])`` for each token, as
    :class:`MoESpec` describes the routing; the ids in descending order of the choice's score."""
    logits = router_logits.float()
    scores = logits.softmax(dim=-1) if spec.scoring == "softmax" else logits.sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if spec.num_expert_groups > 1:
        choice = _mask_to_best_groups(choice, spec)
    _, ids = torch.topk(choice, spec.top_k, dim=-1)
    weights = scores.gather(1, ids)
    if spec.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights * spec.routed_scaling_factor, ids


def _mask_to_best_groups(choice: torch.Tensor, spec: MoESpec) -> torch.Tensor:
    """``choice`` with every expert outside each token's ``topk_groups`` best groups at -inf,
    so that none of them is chosen even where the eligible ones' ``score + bias`` is negative.
    A group's score (``spec.group_score``): the sum of its two best experts' choice scores, as
    DeepSeek-V3 routes, or its best expert's, as DeepSeek-V2's ``group_limited_greedy`` does."""
    tokens = choice.shape[0]
    per_group = spec.num_experts // spec.num_expert_groups
    grouped = choice.view(tokens, spec.num_expert_groups, per_group)
    if spec.group_score == "max":
        group_scores = grouped.amax(dim=-1)
    else:
        group_scores = grouped.topk(min(2, per_group), dim=-1).values.sum(dim=-1)
    best = group_scores.topk(spec.topk_groups, dim=-1).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    masked = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf"))
    return masked.view(tokens, spec.num_experts)


def fused_moe(
    hidden: torch.Tensor,
    router_logits: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    spec: MoESpec,
    correction_bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``[T, H]`` in ``hidden``'s dtype: each token's chosen experts' ``w2 @ (silu(gate) * up)``
    times the token's routing weight (rounded to the model dtype first, as transformers does),
    summed in ascending expert order into zeros. One product per expert the step uses."""
    weights, ids = select_experts(router_logits, spec, correction_bias)
    weights = weights.to(hidden.dtype)
    out = torch.zeros_like(hidden)
    inner = w2.shape[-1]
    for expert in torch.unique(ids).tolist():
        tokens, slot = torch.where(ids == expert)
        rows = hidden[tokens]
        gate_up = F.linear(rows, w13[expert])
        activated = F.silu(gate_up[:, :inner]) * gate_up[:, inner:]
        expert_out = F.linear(activated, w2[expert]) * weights[tokens, slot, None]
        out.index_add_(0, tokens, expert_out)
    return out


def pack_fused_moe(spec: MoESpec, w13: torch.Tensor, w2: torch.Tensor) -> FusedMoEFn:
    """The reference as a platform's ``FusedMoEPacker`` (bound to ``spec``): the weights kept
    as they are."""

    def fn(hidden, router_logits, correction_bias=None):
        return fused_moe(hidden, router_logits, w13, w2, spec, correction_bias)

    return fn
