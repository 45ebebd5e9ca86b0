"""Llama (and the base of Mistral, Qwen2, Qwen3): a decoder-only transformer on the paged cache.

Every model class the runner loads has this interface:

- ``cls(config: ModelConfig, platform: Platform, *, block_size, device, tp=TPGroup())``
- ``forward(input_ids [T], positions [T], attn_metadata) -> hidden_states [T, hidden]``
- ``compute_logits(hidden_states [S, hidden]) -> logits [S, vocab]`` (model dtype)
- ``load_weights(pairs of (checkpoint name, tensor)) -> names consumed`` and
  ``checkpoint_tensor_names() -> names needed``
- its attention layers are :class:`octavo.models.layers.attention.Attention` modules, to which
  the runner binds the KV caches.
"""

from __future__ import annotations

from typing import Iterable, Optional, Union

import torch
from torch import nn

from octavo.errors import ConfigError
from octavo.models.layers.attention import Attention
from octavo.models.layers.decoder_stack import StackedDecoder
from octavo.models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from octavo.models.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    TPGroup,
)
from octavo.models.layers.norm import RMSNorm
from octavo.models.layers.rotary import RotaryEmbedding
from octavo.models.weights import expected_checkpoint_names, load_checkpoint_tensors
from octavo.platform.facade import Platform
from octavo.platform.types import AttentionMetadata

Device = Union[str, torch.device]


class LlamaMLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``; gate and up share one (shardable) weight, and
    ``silu(gate) * up`` is the platform's kernel (``Platform.silu_and_mul``)."""

    def __init__(self, config, platform: Platform, *, device: Device, tp: TPGroup):
        super().__init__()
        if config.hidden_act != "silu":
            raise ConfigError(
                f"hidden_act {config.hidden_act!r} is not supported; the Llama family uses silu"
            )
        size, inner = config.hidden_size, config.intermediate_size
        kw = dict(dtype=config.dtype, device=device, tp=tp)
        self.gate_up_proj = MergedColumnParallelLinear(size, (inner, inner), config.mlp_bias, **kw)
        self.down_proj = RowParallelLinear(inner, size, config.mlp_bias, **kw)
        self.silu_and_mul = platform.silu_and_mul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.forward_parts(x)
        return self.down_proj(self.silu_and_mul(gate, up))


class LlamaAttention(nn.Module):
    """Fused qkv projection, rotary embedding, paged attention, output projection."""

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
        scale: Optional[float] = None,
    ):
        super().__init__()
        self.head_dim = config.head_dim
        self.rotary_embedding = platform.rotary_embedding()
        num_heads = tp.split(config.num_attention_heads, "num_attention_heads")
        _, num_kv_heads = tp.kv_heads(config.num_key_value_heads)
        kw = dict(dtype=config.dtype, device=device, tp=tp)
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            self.head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            qkv_bias,
            **kw,
        )
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim, config.hidden_size, o_bias, **kw
        )
        self.attn = Attention(
            num_heads,
            num_kv_heads,
            self.head_dim,
            platform,
            dtype=config.dtype,
            block_size=block_size,
            scale=scale,
            sliding_window=sliding_window,
        )

    def normalize_qk(self, q: torch.Tensor, k: torch.Tensor):
        """Hook for per-head q/k normalisation before RoPE (Qwen3); identity for Llama."""
        return q, k

    def forward(
        self, hidden: torch.Tensor, cos_sin, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj.split_qkv(self.qkv_proj(hidden))
        q, k = self.normalize_qk(q, k)
        q, k = self.rotary_embedding(cos_sin, q, k, self.head_dim)
        out = self.attn(q, k, v, attn_metadata)
        return self.o_proj(out.reshape(hidden.shape[0], -1))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks, residual adds fused into the following RMSNorm."""

    def __init__(
        self,
        config,
        platform: Platform,
        self_attn: nn.Module,
        *,
        device: Device,
        tp: TPGroup,
        mlp: Optional[nn.Module] = None,
    ):
        super().__init__()
        kw = dict(dtype=config.dtype, device=device)
        self.self_attn = self_attn
        self.mlp = mlp if mlp is not None else LlamaMLP(config, platform, device=device, tp=tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, platform, **kw)
        self.post_attention_layernorm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, platform, **kw
        )

    def forward(self, hidden, residual, cos_sin, attn_metadata):
        """``(hidden, residual)`` in, ``(mlp output, residual)`` out; residual None on layer 0."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, cos_sin, attn_metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(StackedDecoder, nn.Module):
    """Embedding, decoder layers and the final norm (HF module names, so checkpoints map 1:1)."""

    def __init__(
        self, config, platform: Platform, layers: list[nn.Module], *, device: Device, tp: TPGroup
    ):
        super().__init__()
        self.dtype = config.dtype
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, dtype=config.dtype, device=device, tp=tp
        )
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, platform, dtype=config.dtype, device=device
        )
        self.rotary_emb = RotaryEmbedding(
            config.head_dim, config.max_model_len, config.rope, device
        )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata
    ):
        hidden = self.embed_tokens(input_ids)
        cos_sin = self.rotary_emb.cos_sin(positions, self.dtype)
        return self.run_layers(hidden, cos_sin, attn_metadata)


class LlamaForCausalLM(nn.Module):
    """LlamaForCausalLM on the paged KV cache (see the module docstring for the interface)."""

    attention_cls = LlamaAttention
    STACKED_PARAMS = (
        (".qkv_proj.", ".q_proj.", "q"),
        (".qkv_proj.", ".k_proj.", "k"),
        (".qkv_proj.", ".v_proj.", "v"),
        (".gate_up_proj.", ".gate_proj.", 0),
        (".gate_up_proj.", ".up_proj.", 1),
    )

    def __init__(
        self,
        config,
        platform: Platform,
        *,
        block_size: int,
        device: Device,
        tp: TPGroup = TPGroup(),
    ):
        super().__init__()
        self.config = config
        layers = [
            self._make_layer(config, platform, i, block_size, device, tp)
            for i in range(config.num_hidden_layers)
        ]
        self.model = self._make_model(config, platform, layers, device, tp)
        tied = config.tie_word_embeddings
        self.lm_head = ParallelLMHead(
            config.vocab_size,
            config.hidden_size,
            dtype=config.dtype,
            device="meta" if tied else device,
            tp=tp,
        )
        if tied:
            self.lm_head.tie_to(self.model.embed_tokens)

    # --- what differs between family members ---------------------------------------------

    @classmethod
    def attention_biases(cls, config) -> tuple[bool, bool]:
        """(q/k/v projections have biases, output projection has a bias)."""
        return config.attention_bias, config.attention_bias

    @classmethod
    def sliding_window(cls, config, layer_idx: int) -> Optional[int]:
        """The attention window of layer ``layer_idx`` in tokens (None: full attention)."""
        return None

    def _make_model(self, config, platform, layers, device, tp) -> nn.Module:
        """The embedding, the ``layers`` and the final norm (HF's ``model.``)."""
        return LlamaModel(config, platform, layers, device=device, tp=tp)

    def make_mlp(self, config, platform, layer_idx: int, device, tp) -> Optional[nn.Module]:
        """Layer ``layer_idx``'s feed-forward block (None: the Llama MLP)."""
        return None

    def _make_layer(self, config, platform, layer_idx, block_size, device, tp) -> LlamaDecoderLayer:
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
        mlp = self.make_mlp(config, platform, layer_idx, device, tp)
        return LlamaDecoderLayer(config, platform, attn, device=device, tp=tp, mlp=mlp)

    # --- the interface the runner and loader use -----------------------------------------------

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata
    ):
        return self.model(input_ids, positions, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)

    def _skip(self, name: str) -> bool:
        """Tensors the model does not load: RoPE buffers, a tied head, and the layers past the
        decoder stack (a checkpoint's MTP layers, ``octavo.spec_decode.mtp``'s to load)."""
        return (
            "rotary_emb.inv_freq" in name
            or (self.config.tie_word_embeddings and name == "lm_head.weight")
            or _past_the_stack(name, self.config.num_hidden_layers)
        )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_checkpoint_tensors(self, weights, self.STACKED_PARAMS, self._skip)

    def checkpoint_tensor_names(self) -> set[str]:
        return expected_checkpoint_names(self, self.STACKED_PARAMS)


def _past_the_stack(name: str, num_hidden_layers: int) -> bool:
    if not name.startswith("model.layers."):
        return False
    index = name[len("model.layers.") :].split(".", 1)[0]
    return index.isdigit() and int(index) >= num_hidden_layers
