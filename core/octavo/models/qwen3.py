"""Qwen3: Llama with an RMSNorm over each head of q and k before RoPE."""

from __future__ import annotations

from typing import Optional

import torch

from octavo.models.layers.norm import RMSNorm
from octavo.models.llama import LlamaAttention, LlamaForCausalLM
from octavo.models.qwen2 import qwen_sliding_window


class Qwen3Attention(LlamaAttention):
    """Llama attention plus ``q_norm``/``k_norm`` (RMSNorm over ``head_dim``, one weight per model
    layer shared by all heads)."""

    def __init__(self, config, platform, **kwargs):
        super().__init__(config, platform, **kwargs)
        kw = dict(dtype=config.dtype, device=kwargs["device"])
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, platform, **kw)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, platform, **kw)

    def normalize_qk(self, q: torch.Tensor, k: torch.Tensor):
        tokens = q.shape[0]
        q = self.q_norm(q.reshape(-1, self.head_dim)).view(tokens, -1)
        k = self.k_norm(k.reshape(-1, self.head_dim)).view(tokens, -1)
        return q, k


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3ForCausalLM (dense)."""

    attention_cls = Qwen3Attention

    @classmethod
    def sliding_window(cls, config, layer_idx: int) -> Optional[int]:
        return qwen_sliding_window(config.hf_config, layer_idx)
