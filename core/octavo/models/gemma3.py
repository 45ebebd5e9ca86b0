"""Gemma 3 (text): Llama's paged attention with Gemma's own arithmetic around it.

What differs from Llama: the embedding scaled by ``sqrt(hidden_size)`` (rounded to the model
dtype, as transformers does); RMSNorm as ``norm(x) * (1 + weight)`` in float32, four per layer
(before and after attention, before and after the feed-forward block) and over each head of q
and k; attention scaled by ``query_pre_attn_scalar ** -0.5``; sliding-window layers interleaved
with full ones (``layer_types``), each kind with its own RoPE (``rope_parameters`` per layer
type); a GeGLU feed-forward (``gelu_pytorch_tanh``); logits soft-capped when
``final_logit_softcapping`` is set. ``attn_logit_softcapping`` (Gemma 2's) is refused.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from octavo.errors import ConfigError
from octavo.models.layers.embedding import VocabParallelEmbedding
from octavo.models.layers.linear import (
    MergedColumnParallelLinear,
    RowParallelLinear,
    TPGroup,
    default_weight_loader,
)
from octavo.models.layers.rotary import RopeConfig, RotaryEmbedding, parse_rope_config
from octavo.models.llama import LlamaAttention, LlamaForCausalLM
from octavo.platform.facade import Platform
from octavo.platform.types import AttentionMetadata

Device = Union[str, torch.device]
LAYER_TYPES = ("full_attention", "sliding_attention")


def gemma3_rope(hf_config, layer_type: str) -> RopeConfig:
    """A layer type's RoPE: from transformers 5's ``rope_parameters`` per layer type, or from
    transformers 4's format (``rope_theta`` and ``rope_scaling`` for the full layers,
    ``rope_local_base_freq`` unscaled for the sliding ones)."""
    if hf_config.get("rope_parameters") is None and layer_type == "sliding_attention":
        return RopeConfig("default", float(hf_config.get("rope_local_base_freq") or 10000.0))
    return parse_rope_config(hf_config, layer_type)


class GemmaRMSNorm(nn.Module):
    """``x * rsqrt(mean(x^2) + eps) * (1 + weight)`` in float32, rounded to ``x``'s dtype."""

    def __init__(self, hidden_size: int, eps: float, *, dtype: torch.dtype, device: Device):
        super().__init__()
        self.eps = eps
        weight = torch.zeros(hidden_size, dtype=dtype, device=device)
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight.weight_loader = default_weight_loader

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class GemmaMLP(nn.Module):
    """GeGLU: ``down(gelu_tanh(gate(x)) * up(x))``."""

    def __init__(self, config, *, device: Device, tp: TPGroup):
        super().__init__()
        act = config.hf_config.get("hidden_activation") or config.hf_config.get("hidden_act")
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ConfigError(f"Gemma 3's activation {act!r} is not supported: gelu_pytorch_tanh")
        size, inner = config.hidden_size, config.intermediate_size
        kw = dict(dtype=config.dtype, device=device, tp=tp)
        self.gate_up_proj = MergedColumnParallelLinear(size, (inner, inner), False, **kw)
        self.down_proj = RowParallelLinear(inner, size, False, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.forward_parts(x)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3Attention(LlamaAttention):
    """Llama attention scaled by ``query_pre_attn_scalar ** -0.5`` with Gemma RMSNorms over each
    head of q and k before RoPE."""

    def __init__(self, config, platform, **kwargs):
        scale = float(config.hf_config.get("query_pre_attn_scalar", config.head_dim)) ** -0.5
        super().__init__(config, platform, scale=scale, **kwargs)
        kw = dict(dtype=config.dtype, device=kwargs["device"])
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps, **kw)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps, **kw)

    def normalize_qk(self, q: torch.Tensor, k: torch.Tensor):
        tokens = q.shape[0]
        q = self.q_norm(q.reshape(-1, self.head_dim)).view(tokens, -1)
        k = self.k_norm(k.reshape(-1, self.head_dim)).view(tokens, -1)
        return q, k


class Gemma3DecoderLayer(nn.Module):
    """Sandwich norms: attention and the feed-forward block each between two RMSNorms, the
    residual added after the second."""

    def __init__(self, config, self_attn: nn.Module, layer_type: str, *, device, tp):
        super().__init__()
        self.layer_type = layer_type
        self.self_attn = self_attn
        self.mlp = GemmaMLP(config, device=device, tp=tp)
        kw = dict(dtype=config.dtype, device=device)
        for name in (
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        ):
            setattr(self, name, GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, **kw))

    def forward(self, hidden, cos_sin_by_type, attn_metadata):
        attended = self.self_attn(
            self.input_layernorm(hidden), cos_sin_by_type[self.layer_type], attn_metadata
        )
        hidden = hidden + self.post_attention_layernorm(attended)
        fed = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(fed)


class Gemma3Model(nn.Module):
    """Embedding (scaled), the layers with a RoPE table per layer type, the final norm."""

    def __init__(self, config, layers: list[nn.Module], *, device: Device, tp: TPGroup):
        super().__init__()
        self.dtype = config.dtype
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, dtype=config.dtype, device=device, tp=tp
        )
        self.normalizer = float(torch.tensor(config.hidden_size**0.5, dtype=config.dtype))
        self.layers = nn.ModuleList(layers)
        self.norm = GemmaRMSNorm(
            config.hidden_size, config.rms_norm_eps, dtype=config.dtype, device=device
        )
        self.rotary_embs = nn.ModuleDict(
            {
                layer_type: RotaryEmbedding(
                    config.head_dim,
                    config.max_model_len,
                    gemma3_rope(config.hf_config, layer_type),
                    device,
                )
                for layer_type in sorted({layer.layer_type for layer in layers})
            }
        )

    def forward(self, input_ids, positions, attn_metadata: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids) * self.normalizer
        cos_sin = {t: rope.cos_sin(positions, self.dtype) for t, rope in self.rotary_embs.items()}
        for layer in self.layers:
            hidden = layer(hidden, cos_sin, attn_metadata)
        return self.norm(hidden)


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma3ForCausalLM (text only; the HF names, so checkpoints map 1:1)."""

    attention_cls = Gemma3Attention

    def __init__(
        self, config, platform: Platform, *, block_size: int, device: Device, tp=TPGroup()
    ):
        hf = config.hf_config
        if hf.get("attn_logit_softcapping") is not None:
            raise ConfigError(
                "attn_logit_softcapping (Gemma 2's attention soft-capping) is not supported by "
                "octavo's attention backends; Gemma 3 checkpoints leave it null"
            )
        if hf.get("use_bidirectional_attention"):
            raise ConfigError("use_bidirectional_attention (an encoder's attention) is refused")
        self.final_logit_softcapping = hf.get("final_logit_softcapping")
        super().__init__(config, platform, block_size=block_size, device=device, tp=tp)

    @classmethod
    def layer_type(cls, config, layer_idx: int) -> str:
        layer_types = config.hf_config.get("layer_types")
        if layer_types is None:
            pattern = int(config.hf_config.get("sliding_window_pattern", 6))
            return "sliding_attention" if (layer_idx + 1) % pattern else "full_attention"
        if layer_types[layer_idx] not in LAYER_TYPES:
            raise ConfigError(f"layer type {layer_types[layer_idx]!r}: use one of {LAYER_TYPES}")
        return layer_types[layer_idx]

    @classmethod
    def sliding_window(cls, config, layer_idx: int) -> Optional[int]:
        if cls.layer_type(config, layer_idx) != "sliding_attention":
            return None
        return config.hf_config.get("sliding_window")

    def _make_layer(self, config, platform, layer_idx, block_size, device, tp):
        qkv_bias, o_bias = self.attention_biases(config)
        attn = self.attention_cls(
            config,
            platform,
            block_size=block_size,
            device=device,
            tp=tp,
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            sliding_window=self.sliding_window(config, layer_idx),
        )
        layer_type = self.layer_type(config, layer_idx)
        return Gemma3DecoderLayer(config, attn, layer_type, device=device, tp=tp)

    def _make_model(self, config, platform, layers, device, tp):
        return Gemma3Model(config, layers, device=device, tp=tp)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden_states)
        cap = self.final_logit_softcapping
        if cap is None:
            return logits
        return torch.tanh(logits / cap) * cap  # in the logits' dtype, as transformers does
