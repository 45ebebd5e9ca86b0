"""Multi-head latent attention (DeepSeek-V2/V3): the KV cache holds, per token and layer, the
compressed latent and the rotary key part, one row shared by every head; attention runs in the
latent space (the key up-projection absorbed into the queries, the value up-projection applied
to the output), on the platform's MLA backend (``Platform.mla_attention_backend``).

The projections keep HF's names (``q_a_proj``/``q_a_layernorm``/``q_b_proj`` or ``q_proj``,
``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``). Under tensor
parallelism the heads are split across ranks; the latent projections are replicated.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import nn

from octavo.errors import ConfigError
from octavo.models.layers.attention import Attention
from octavo.models.layers.linear import ColumnParallelLinear, RowParallelLinear, TPGroup
from octavo.models.layers.norm import RMSNorm
from octavo.platform.facade import Platform
from octavo.platform.types import AttentionMetadata, MLASpec

Device = Union[str, torch.device]


class MLAAttention(Attention):
    """Paged latent attention over one layer's cache of ``[latent, rotary key]`` rows (found by
    the model runner as an :class:`Attention`, which binds its ``kv_cache``)."""

    def __init__(self, spec: MLASpec, platform: Platform):
        nn.Module.__init__(self)
        self.spec = spec
        self.backend = platform.mla_attention_backend(spec)
        self.kv_cache: Optional[torch.Tensor] = None

    def forward(self, query, kv_row, attn_metadata: AttentionMetadata) -> torch.Tensor:
        assert self.kv_cache is not None, "the model runner binds KV caches before the first step"
        return self.backend.forward(query, kv_row, self.kv_cache, attn_metadata)

    def extra_repr(self) -> str:
        s = self.spec
        return f"heads={s.num_heads}, latent={s.kv_lora_rank}+{s.qk_rope_head_dim}"


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Rotary pairs stored interleaved ``(x0, x1), (x2, x3), ...`` as two halves (HF's
    ``rope_interleave``): the layout ``rotate_half`` rotates."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


class DeepseekAttention(nn.Module):
    """DeepSeek's MLA block. ``attention_cls`` of a Llama-family model (same constructor)."""

    def __init__(
        self,
        config,
        platform: Platform,
        *,
        block_size: int,
        device: Device,
        tp: TPGroup,
        qkv_bias: bool,
        o_bias: bool,
        sliding_window: Optional[int],
    ):
        super().__init__()
        hf = config.hf_config
        if sliding_window is not None:
            raise ConfigError("multi-head latent attention has no sliding window")
        self.num_heads = tp.split(config.num_attention_heads, "num_attention_heads")
        self.nope, self.rope = int(hf["qk_nope_head_dim"]), int(hf["qk_rope_head_dim"])
        self.v_dim, self.latent = int(hf["v_head_dim"]), int(hf["kv_lora_rank"])
        self.q_lora_rank = hf.get("q_lora_rank")
        self.interleaved = bool(hf.get("rope_interleave", False))
        heads, size = config.num_attention_heads, config.hidden_size
        kw = dict(dtype=config.dtype, device=device, tp=tp)
        norm_kw = dict(dtype=config.dtype, device=device)
        q_width = heads * (self.nope + self.rope)
        if self.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(size, (q_width,), False, **kw)
        else:
            rank = int(self.q_lora_rank)
            self.q_a_proj = _replicated(size, rank, qkv_bias, **kw)
            self.q_a_layernorm = RMSNorm(rank, config.rms_norm_eps, platform, **norm_kw)
            self.q_b_proj = ColumnParallelLinear(rank, (q_width,), False, **kw)
        self.kv_a_proj_with_mqa = _replicated(size, self.latent + self.rope, qkv_bias, **kw)
        self.kv_a_layernorm = RMSNorm(self.latent, config.rms_norm_eps, platform, **norm_kw)
        kv_b_width = heads * (self.nope + self.v_dim)
        self.kv_b_proj = ColumnParallelLinear(self.latent, (kv_b_width,), False, **kw)
        self.o_proj = RowParallelLinear(heads * self.v_dim, size, o_bias, **kw)
        self.rotary_embedding = platform.rotary_embedding()
        scale = (self.nope + self.rope) ** -0.5 * config.rope.softmax_scale_factor()
        spec = MLASpec(self.num_heads, self.latent, self.rope, config.dtype, block_size, scale)
        self.attn = MLAAttention(spec, platform)

    def _queries(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.q_lora_rank is None:
            q = self.q_proj(hidden)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        return q.view(hidden.shape[0], self.num_heads, self.nope + self.rope)

    def forward(self, hidden: torch.Tensor, cos_sin, attn_metadata: AttentionMetadata):
        tokens = hidden.shape[0]
        q = self._queries(hidden)
        latent, k_rope = self.kv_a_proj_with_mqa(hidden).split((self.latent, self.rope), dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous())
        q_rope, k_rope = q[..., self.nope :], k_rope
        if self.interleaved:
            q_rope, k_rope = _deinterleave(q_rope), _deinterleave(k_rope)
        q_rope, k_rope = self.rotary_embedding(
            cos_sin,
            q_rope.reshape(tokens, -1).clone(),
            k_rope.reshape(tokens, -1).clone(),
            self.rope,
        )
        # the key up-projection absorbed into the queries: q_nope . (W_uk c) = (W_uk^T q_nope) . c
        w_kv_b = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.latent)
        w_uk, w_uv = w_kv_b[:, : self.nope], w_kv_b[:, self.nope :]
        q_latent = torch.einsum("thn,hnl->thl", q[..., : self.nope].float(), w_uk.float())
        query = torch.cat((q_latent.to(q.dtype), q_rope.view(tokens, self.num_heads, -1)), -1)
        kv_row = torch.cat((latent, k_rope.view(tokens, -1)), dim=-1)
        out_latent = self.attn(query, kv_row, attn_metadata)
        out = torch.einsum("thl,hvl->thv", out_latent.float(), w_uv.float()).to(hidden.dtype)
        return self.o_proj(out.reshape(tokens, -1))


def _replicated(input_size: int, output_size: int, bias: bool, *, dtype, device, tp):
    """A linear layer every rank holds whole (the latent projections)."""
    return ColumnParallelLinear(
        input_size,
        (output_size,),
        bias,
        dtype=dtype,
        device=device,
        tp=tp,
        shards=((0, output_size),),
    )
