"""Multi-head latent attention (DeepSeek-V2/V3): the KV cache holds, per token and layer, the
compressed latent and the rotary key part, one row shared by every head.

Two forms compute the same attention, chosen per step by their cost (:func:`prefers_expanded`):

- absorbed (decode): the key up-projection absorbed into the queries, attention in the latent
  space on the platform's MLA backend (``Platform.mla_attention_backend``), the value
  up-projection applied to the output; per query token it costs one absorption, per attended
  row ``2 * kv_lora_rank + qk_rope_head_dim`` per head;
- expanded (prefill): the step's rows written, each request's rows read back and up-projected
  to per-head keys and values once, then ordinary causal attention over ``qk_nope + qk_rope``
  and ``v_head_dim``; per context row it costs one up-projection, per attended pair far less.

``OCTAVO_MLA_FORM`` (``auto``, ``absorbed``, ``expanded``) pins one form, for benchmarks and
for comparing them; ``auto`` is the default.

The projections keep HF's names (``q_a_proj``/``q_a_layernorm``/``q_b_proj`` or ``q_proj``,
``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``). Under tensor
parallelism the heads are split across ranks; the latent projections are replicated.
"""

from __future__ import annotations

import os
from typing import Optional, Union

import torch
import torch.nn.functional as F
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

    def write_context(self, kv_row, attn_metadata: AttentionMetadata) -> torch.Tensor:
        """Store the step's rows and return every request's rows, ``[num_context_tokens,
        row_width]`` in request order (the expanded form's keys and values, compressed)."""
        assert self.kv_cache is not None, "the model runner binds KV caches before the first step"
        self.backend.write_rows(kv_row, self.kv_cache, attn_metadata)
        return context_rows(self.kv_cache, attn_metadata)

    def extra_repr(self) -> str:
        s = self.spec
        return f"heads={s.num_heads}, latent={s.kv_lora_rank}+{s.qk_rope_head_dim}"


MLA_FORMS = ("auto", "absorbed", "expanded")


def mla_form_from_env() -> str:
    """``OCTAVO_MLA_FORM``, checked: a misspelt value fails at load, not silently ``auto``."""
    form = os.environ.get("OCTAVO_MLA_FORM", "auto")
    if form not in MLA_FORMS:
        raise ConfigError(f"OCTAVO_MLA_FORM={form!r}: expected one of {', '.join(MLA_FORMS)}")
    return form


def prefers_expanded(metadata: AttentionMetadata, num_tokens: int, dims) -> bool:
    """Whether the expanded form costs less this step. ``dims`` is ``(qk_nope, v_head,
    kv_lora_rank)``. Both forms pay one ``(qk_nope + v_head) x kv_lora_rank`` product per head:
    the absorbed per query token, the expanded per context row. Per attended pair the absorbed
    reads ``2 * kv_lora_rank + rope`` per head, the expanded ``qk_nope + rope + v_head``. Pairs
    are estimated as ``tokens x mean context``; without host context counts the absorbed form
    serves (it needs none)."""
    context, reqs = metadata.num_context_tokens, metadata.num_reqs
    if context <= 0 or reqs == 0:
        return False
    nope, v_dim, latent = dims
    pairs = num_tokens * context / reqs
    return pairs * (2 * latent - nope - v_dim) > (nope + v_dim) * latent * (context - num_tokens)


def context_rows(kv_cache: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
    """Each request's rows ``0..seq_len-1`` through its block table, requests in order (the
    layout ``[num_blocks, block_size, row_width]`` is the backend contract's)."""
    block_size = kv_cache.shape[1]
    seq_lens = metadata.seq_lens.long()
    total = metadata.num_context_tokens
    request = torch.repeat_interleave(
        torch.arange(seq_lens.shape[0], device=seq_lens.device), seq_lens, output_size=total
    )
    starts = torch.cumsum(seq_lens, 0) - seq_lens
    position = torch.arange(total, device=seq_lens.device) - starts[request]
    block = metadata.block_table.long()[request, position // block_size]
    return kv_cache.view(-1, kv_cache.shape[-1])[block * block_size + position % block_size]


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
        self.form = mla_form_from_env()

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
        q_nope, q_rope = q[..., : self.nope], q_rope.view(tokens, self.num_heads, -1)
        kv_row = torch.cat((latent, k_rope.view(tokens, -1)), dim=-1)
        if self._expanded(attn_metadata, tokens):
            out = self._expanded_attention(torch.cat((q_nope, q_rope), -1), kv_row, attn_metadata)
        else:
            out = self._absorbed_attention(q_nope, q_rope, kv_row, attn_metadata)
        return self.o_proj(out.to(hidden.dtype).reshape(tokens, -1))

    def _expanded(self, attn_metadata: AttentionMetadata, tokens: int) -> bool:
        if self.form != "auto":
            return self.form == "expanded" and attn_metadata.num_context_tokens >= 0
        return prefers_expanded(attn_metadata, tokens, (self.nope, self.v_dim, self.latent))

    def _absorbed_attention(self, q_nope, q_rope, kv_row, attn_metadata) -> torch.Tensor:
        """The key up-projection absorbed into the queries, ``q_nope . (W_uk c) = (W_uk^T
        q_nope) . c``; attention over the latent rows; the value up-projection on the output."""
        w_kv_b = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.latent)
        w_uk, w_uv = w_kv_b[:, : self.nope], w_kv_b[:, self.nope :]
        q_latent = torch.einsum("thn,hnl->thl", q_nope.float(), w_uk.float())
        query = torch.cat((q_latent.to(q_rope.dtype), q_rope), -1)
        out_latent = self.attn(query, kv_row, attn_metadata)
        return torch.einsum("thl,hvl->thv", out_latent.float(), w_uv.float())

    def _expanded_attention(self, query, kv_row, attn_metadata) -> torch.Tensor:
        """Every request's rows up-projected to per-head keys and values, then causal attention
        per request (its new tokens are the last of its context)."""
        rows = self.attn.write_context(kv_row, attn_metadata).to(query.dtype)
        kv = self.kv_b_proj(rows[:, : self.latent]).view(rows.shape[0], self.num_heads, -1)
        k_rope = rows[:, None, self.latent :].expand(-1, self.num_heads, -1)
        keys = torch.cat((kv[..., : self.nope], k_rope), -1).transpose(0, 1)
        values = kv[..., self.nope :].transpose(0, 1)
        queries = query.transpose(0, 1)
        out = query.new_zeros(self.num_heads, query.shape[0], self.v_dim)
        seq_lens = attn_metadata.seq_lens.tolist()
        starts = attn_metadata.query_start_loc.tolist()
        context_start = 0
        for r, seq_len in enumerate(seq_lens):
            start, end = starts[r], starts[r + 1]
            context = slice(context_start, context_start + seq_len)
            context_start += seq_len
            if end > start:
                out[:, start:end] = _causal_attention(
                    queries[:, start:end], keys[:, context], values[:, context], self.attn.spec
                )
        return out.transpose(0, 1)


def _causal_attention(q, k, v, spec: MLASpec) -> torch.Tensor:
    """``[heads, new, v]``: ``new`` queries, the last of ``len(k)`` positions, attend causally."""
    new, total = q.shape[1], k.shape[1]
    mask = None
    if new != total:
        mask = (
            torch.arange(total, device=q.device)[None, :]
            <= torch.arange(total - new, total, device=q.device)[:, None]
        )
    out = F.scaled_dot_product_attention(
        q.unsqueeze(0),
        k.unsqueeze(0),
        v.unsqueeze(0),
        attn_mask=mask,
        is_causal=mask is None,
        scale=spec.scale,
    )
    return out.squeeze(0)


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
