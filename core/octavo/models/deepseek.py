"""DeepSeek-V3 (and its MTP-less base) and DeepSeek-V2: multi-head latent attention
(:mod:`octavo.models.layers.mla`) and Mixture-of-Experts blocks with shared experts, the first
``first_k_dense_replace`` layers dense. The MTP layers past the stack are
``octavo.spec_decode.mtp``'s to load.

V3 routes by sigmoid scores with a score-correction bias, groups scored by their two best
experts. V2 routes by softmax scores without a bias, by plain top-k (``greedy``) or with groups
scored by their best expert (``group_limited_greedy``), the weights never renormalised (as
transformers computes it), and rotates its interleaved rotary pairs in float32.

RoPE scaling other than the Llama family's (DeepSeek's YaRN) is refused at load by
``octavo.models.layers.rotary``.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from octavo.errors import ConfigError
from octavo.models.layers.fused_moe import FusedExperts, expert_stacked_params
from octavo.models.layers.linear import TPGroup, default_weight_loader
from octavo.models.layers.mla import DeepseekAttention
from octavo.models.layers.rotary import RotaryEmbedding
from octavo.models.llama import LlamaForCausalLM, LlamaMLP
from octavo.platform.types import MoESpec


class DeepseekRouter(nn.Module):
    """The router: logits in float32 (as transformers computes them) and, with
    ``correction_bias``, the score-correction bias that shifts which experts are chosen
    (``e_score_correction_bias``, float32; None without). The weight is held in ``weight_dtype``
    (None: the model's)."""

    def __init__(
        self, config, num_experts: int, *, device, correction_bias: bool = True, weight_dtype=None
    ):
        super().__init__()
        dtype = weight_dtype or config.dtype
        weight = torch.empty(num_experts, config.hidden_size, dtype=dtype, device=device)
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight.weight_loader = default_weight_loader
        self.e_score_correction_bias = None
        if correction_bias:
            bias = torch.zeros(num_experts, dtype=torch.float32, device=device)
            self.e_score_correction_bias = nn.Parameter(bias, requires_grad=False)
            self.e_score_correction_bias.weight_loader = default_weight_loader

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden.float(), self.weight.float())


class DeepseekMoE(nn.Module):
    """Routed experts (the platform's fused MoE) plus the shared experts every token uses."""

    def __init__(self, config, platform, spec: MoESpec, *, device, tp: TPGroup, **router):
        super().__init__()
        hf = config.hf_config
        self.gate = DeepseekRouter(config, spec.num_experts, device=device, **router)
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


def _expert_shape(config, tp: TPGroup) -> dict:
    """The experts' count, width and activation (MoESpec's fields), shared by V2 and V3."""
    hf = config.hf_config
    return dict(
        num_experts=int(hf.get("n_routed_experts") or hf["num_local_experts"]),
        top_k=int(hf["num_experts_per_tok"]),
        hidden_size=config.hidden_size,
        intermediate_size=tp.split(int(hf["moe_intermediate_size"]), "moe_intermediate_size"),
        dtype=config.dtype,
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
    )


def deepseek_moe_spec(config, tp: TPGroup) -> MoESpec:
    """V3's routing: sigmoid, groups scored by their two best experts, ``norm_topk_prob``."""
    hf = config.hf_config
    return MoESpec(
        **_expert_shape(config, tp),
        scoring="sigmoid",
        renormalize=bool(hf.get("norm_topk_prob", True)),
        num_expert_groups=int(hf.get("n_group") or 1),
        topk_groups=int(hf.get("topk_group") or 1),
    )


V2_TOPK_METHODS = ("greedy", "group_limited_greedy")


def deepseek_v2_moe_spec(config, tp: TPGroup) -> MoESpec:
    """V2's routing as transformers computes it: softmax, plain top-k or (``group_limited_greedy``)
    top-k among the ``topk_group`` groups of the best single expert, never renormalised, times
    ``routed_scaling_factor``. What transformers' V2 does not do is refused, not guessed."""
    hf = config.hf_config
    method = hf.get("topk_method") or "greedy"
    if method not in V2_TOPK_METHODS:
        raise ConfigError(
            f"DeepseekV2ForCausalLM: topk_method {method!r} is not supported; set it to one of "
            f"{', '.join(V2_TOPK_METHODS)} (transformers' DeepSeek-V2 routes by those alone)"
        )
    if hf.get("norm_topk_prob"):
        raise ConfigError(
            "DeepseekV2ForCausalLM: norm_topk_prob=true is refused: transformers' DeepSeek-V2 "
            "never renormalises the routing weights while DeepSeek's original code would; set it "
            "to false for transformers' routing"
        )
    grouped = method == "group_limited_greedy"
    try:
        return MoESpec(
            **_expert_shape(config, tp),
            scoring="softmax",
            renormalize=False,
            num_expert_groups=int(hf.get("n_group") or 1) if grouped else 1,
            topk_groups=int(hf.get("topk_group") or 1) if grouped else 1,
            group_score="max",
            activation=hf.get("hidden_act") or "silu",
        )
    except ValueError as error:  # the groups or the activation: say which setting to change
        raise ConfigError(f"DeepseekV2ForCausalLM: {error} (n_group, topk_group, hidden_act)")


class DeepseekV3ForCausalLM(LlamaForCausalLM):
    """DeepseekV3ForCausalLM: MLA attention; MoE from layer ``first_k_dense_replace`` on."""

    attention_cls = DeepseekAttention
    rotary_cls = RotaryEmbedding
    moe_spec_of = staticmethod(deepseek_moe_spec)
    router = {}  # DeepseekRouter's options: V3's has the correction bias

    def __init__(self, config, platform, **kwargs):
        self.moe_spec = self.moe_spec_of(config, kwargs.get("tp", TPGroup()))
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
        return DeepseekMoE(config, platform, self.moe_spec, device=device, tp=tp, **self.router)

    def _make_model(self, config, platform, layers, device, tp):
        model = super()._make_model(config, platform, layers, device, tp)
        rope_dim = int(config.hf_config["qk_rope_head_dim"])
        model.rotary_emb = self.rotary_cls(rope_dim, config.max_model_len, config.rope, device)
        return model


class Float32RotaryEmbedding(RotaryEmbedding):
    """Cos/sin tables handed out in float32 whatever the activations' dtype: DeepSeek-V2 rotates
    in float32 (transformers multiplies the pairs as complex numbers in float32, then rounds)."""

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        return super().cos_sin(positions, torch.float32)


class DeepseekV2Attention(DeepseekAttention):
    """V3's latent attention with V2's rotary: the rotary parts always stored as interleaved
    pairs (V2's configs have no ``rope_interleave``; the de-interleaved layout rotates the same
    pairs, and q and k permuted alike leave their dot products unchanged), rotated in float32
    and rounded to the activations' dtype afterwards, as transformers' complex product is."""

    def __init__(self, config, platform, **kwargs):
        super().__init__(config, platform, **kwargs)
        self.interleaved = True
        self.rotate_in_dtype = self.rotary_embedding
        self.rotary_embedding = self._rotate_in_float32

    def _rotate_in_float32(self, cos_sin, query, key, head_dim: int):
        q, k = self.rotate_in_dtype(cos_sin, query.float(), key.float(), head_dim)
        return q.to(query.dtype), k.to(key.dtype)


class DeepseekV2ForCausalLM(DeepseekV3ForCausalLM):
    """DeepseekV2ForCausalLM (V2, V2-Lite, V2.5): V3's stack with V2's routing (softmax, no
    correction bias, the router's weight kept in float32 as transformers keeps it) and rotary
    (:class:`DeepseekV2Attention`); ``q_lora_rank`` null (Lite) means a plain ``q_proj``."""

    attention_cls = DeepseekV2Attention
    rotary_cls = Float32RotaryEmbedding
    moe_spec_of = staticmethod(deepseek_v2_moe_spec)
    router = {"correction_bias": False, "weight_dtype": torch.float32}
