"""DeepSeek-V3 (and its MTP-less base): multi-head latent attention
(:mod:`octavo.models.layers.mla`) and Mixture-of-Experts blocks with sigmoid, group-limited
routing, a score-correction bias and shared experts; the first ``first_k_dense_replace`` layers
dense. The MTP layers past the stack are ``octavo.spec_decode.mtp``'s to load.

RoPE scaling other than the Llama family's (DeepSeek's YaRN) is refused at load by
``octavo.models.layers.rotary``.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from octavo.models.layers.fused_moe import FusedExperts, expert_stacked_params
from octavo.models.layers.linear import TPGroup, default_weight_loader
from octavo.models.layers.mla import DeepseekAttention
from octavo.models.layers.rotary import RotaryEmbedding
from octavo.models.llama import LlamaForCausalLM, LlamaMLP
from octavo.platform.types import MoESpec


class DeepseekRouter(nn.Module):
    """The router: logits in float32 (as transformers computes them) and the score-correction
    bias that shifts which experts are chosen (``e_score_correction_bias``, float32)."""

    def __init__(self, config, num_experts: int, *, device):
        super().__init__()
        weight = torch.empty(num_experts, config.hidden_size, dtype=config.dtype, device=device)
        bias = torch.zeros(num_experts, dtype=torch.float32, device=device)
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(bias, requires_grad=False)
        for param in (self.weight, self.e_score_correction_bias):
            param.weight_loader = default_weight_loader

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden.float(), self.weight.float())


class DeepseekMoE(nn.Module):
    """Routed experts (the platform's fused MoE) plus the shared experts every token uses."""

    def __init__(self, config, platform, spec: MoESpec, *, device, tp: TPGroup):
        super().__init__()
        hf = config.hf_config
        self.gate = DeepseekRouter(config, spec.num_experts, device=device)
        self.experts = FusedExperts(spec, device=device, tp=tp)
        shared = int(hf.get("n_shared_experts") or 0)
        self.shared_experts = None
        if shared:
            inner = int(hf["moe_intermediate_size"]) * shared
            shared_config = dataclasses.replace(config, intermediate_size=inner)
            self.shared_experts = LlamaMLP(shared_config, platform, device=device, tp=tp)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.experts(hidden, self.gate(hidden), self.gate.e_score_correction_bias)
        return out if self.shared_experts is None else out + self.shared_experts(hidden)


def deepseek_moe_spec(config, tp: TPGroup) -> MoESpec:
    hf = config.hf_config
    return MoESpec(
        num_experts=int(hf.get("n_routed_experts") or hf["num_local_experts"]),
        top_k=int(hf["num_experts_per_tok"]),
        hidden_size=config.hidden_size,
        intermediate_size=tp.split(int(hf["moe_intermediate_size"]), "moe_intermediate_size"),
        dtype=config.dtype,
        scoring="sigmoid",
        renormalize=bool(hf.get("norm_topk_prob", True)),
        num_expert_groups=int(hf.get("n_group") or 1),
        topk_groups=int(hf.get("topk_group") or 1),
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
    )


class DeepseekV3ForCausalLM(LlamaForCausalLM):
    """DeepseekV3ForCausalLM: MLA attention; MoE from layer ``first_k_dense_replace`` on."""

    attention_cls = DeepseekAttention

    def __init__(self, config, platform, **kwargs):
        self.moe_spec = deepseek_moe_spec(config, kwargs.get("tp", TPGroup()))
        self.STACKED_PARAMS = (  # the experts' names first: they contain ``.gate_proj.`` too
            *expert_stacked_params(
                self.moe_spec.num_experts, ("gate_proj", "up_proj", "down_proj")
            ),
            (".gate_up_proj.", ".gate_proj.", 0),  # the dense and the shared experts' MLPs
            (".gate_up_proj.", ".up_proj.", 1),
        )
        super().__init__(config, platform, **kwargs)

    def make_mlp(self, config, platform, layer_idx: int, device, tp):
        if layer_idx < int(config.hf_config.get("first_k_dense_replace") or 0):
            return None
        return DeepseekMoE(config, platform, self.moe_spec, device=device, tp=tp)

    def _make_model(self, config, platform, layers, device, tp):
        model = super()._make_model(config, platform, layers, device, tp)
        rope_dim = int(config.hf_config["qk_rope_head_dim"])
        model.rotary_emb = RotaryEmbedding(rope_dim, config.max_model_len, config.rope, device)
        return model
