"""EAGLE's draft head for a Llama-family target: a decoder layer (EAGLE's one, or a few) that
reads, at position p, the target's hidden state at p (after its final norm) and the embedding of
the token at p + 1, and predicts the target's hidden state at p + 1; the target's own LM head
turns that into the next token's logits, and the prediction feeds the head's next step (K
serial steps per verify step).

A head folder holds ``config.json`` (a Llama config of its layers, usually one,
``"architectures": ["EagleHead"]``, the target's ``hidden_size`` and ``vocab_size``) and
``model.safetensors``: ``fc.weight [hidden, 2 * hidden]`` (the concatenation ``[embedding,
hidden state]`` down to one hidden state), ``layers.{i}.*`` (Llama names), ``norm.weight``. Its
embedding and LM head are the target's, not stored.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import numpy as np
import torch
from torch import nn
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from octavo.errors import ConfigError
from octavo.models.layers.decoder_stack import StackedDecoder
from octavo.models.layers.linear import ColumnParallelLinear, TPGroup
from octavo.models.layers.norm import RMSNorm
from octavo.models.layers.rotary import RotaryEmbedding
from octavo.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
from octavo.models.weights import expected_checkpoint_names, load_checkpoint_tensors

ARCHITECTURE = "EagleHead"


class EagleHead(StackedDecoder, nn.Module):
    """The head; built by the loader (``model_cls``), then ``attach``-ed to its target."""

    STACKED_PARAMS = LlamaForCausalLM.STACKED_PARAMS
    # The platform's one-call forward of this head (``octavo_draft_head``), set by ``attach``.
    head_pass: Optional[Callable[..., torch.Tensor]] = None

    def __init__(
        self,
        config,
        platform,
        *,
        block_size: int,
        device,
        tp: TPGroup = TPGroup(),
        num_layers: Optional[int] = None,
    ):
        """``num_layers``: its decoder layers, the config's own (a head's config.json) unless
        given."""
        super().__init__()
        self.dtype = config.dtype
        hidden = config.hidden_size
        # Replicated on every rank, and packed by the platform like the layer's linears.
        self.fc = ColumnParallelLinear(
            2 * hidden, (hidden,), bias=False, dtype=config.dtype, device=device
        )
        count = config.num_hidden_layers if num_layers is None else num_layers
        self.layers = nn.ModuleList(
            _decoder_layer(config, platform, block_size, device, tp) for _ in range(count)
        )
        self.norm = RMSNorm(
            hidden, config.rms_norm_eps, platform, dtype=config.dtype, device=device
        )
        self.rotary_emb = RotaryEmbedding(
            config.head_dim, config.max_model_len, config.rope, device
        )
        self._target: Any = None

    def attach(self, target: nn.Module, platform: Any = None) -> None:
        """Use ``target``'s token embedding and LM head (kept out of this module's weights), and
        ``platform``'s one-call forward of the head where it has one."""
        object.__setattr__(self, "_target", target)
        self.head_pass = None if platform is None else platform.draft_head(self)

    @property
    def embed_tokens(self) -> nn.Module:
        """The target's token embedding (the head reads it; attached)."""
        return self._target.model.embed_tokens

    @property
    def lm_head(self) -> nn.Module:
        """The target's LM head (it scores the head's predictions; attached)."""
        return self._target.lm_head

    def forward(self, input_ids, hidden_states, positions, attn_metadata) -> torch.Tensor:
        """The predicted hidden states (after the norm) for the positions after ``positions``,
        from the tokens there (``input_ids``) and the hidden states at ``positions``."""
        one_call = self.one_call()
        if one_call is not None:
            return one_call(input_ids, hidden_states, positions, attn_metadata)
        embeds, hidden = self.inputs(input_ids, hidden_states)
        return self.predict(embeds, hidden, positions, attn_metadata)

    def one_call(self, method: Optional[str] = None) -> Optional[Callable[..., Any]]:
        """The platform's one-call forward of the head (or its ``method``, where it has that)
        when it runs: where the platform has one, except under a dispatch mode (the start-up
        profile run counts the modules' allocations)."""
        if self.head_pass is None or is_in_torch_dispatch_mode():
            return None
        return self.head_pass if method is None else getattr(self.head_pass, method, None)

    def inputs(self, input_ids, hidden_states) -> tuple[torch.Tensor, torch.Tensor]:
        """``(embeddings, hidden states)`` as ``fc`` reads them."""
        embeds = self.embed_tokens(input_ids)
        return embeds, hidden_states.to(embeds.dtype)

    def predict(self, embeds, hidden_states, positions, attn_metadata) -> torch.Tensor:
        """``fc`` of the pair, the decoder layer, the norm."""
        hidden = self.fc(torch.cat([embeds, hidden_states], dim=-1))
        cos_sin = self.rotary_emb.cos_sin(positions, self.dtype)
        return self.run_layers(hidden, cos_sin, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The target's logits from the head's predictions: the target's LM head, or the
        platform's one call (which may keep its own copy of it, as the head's weights)."""
        one_call = self.one_call("compute_logits")
        if one_call is not None:
            return one_call(hidden_states)
        return self._target.compute_logits(hidden_states)

    def greedy_drafts(self, hidden_states: torch.Tensor, argmax) -> np.ndarray:
        """Each row's argmax of the target's logits from ``hidden_states`` (greedy drafts), on
        the host: the platform's one call where it has one, else ``argmax(logits)``."""
        one_call = self.one_call("greedy_drafts")
        if one_call is not None:
            return one_call(hidden_states).numpy()
        return argmax(self.compute_logits(hidden_states))

    def _skip(self, name: str) -> bool:
        return "rotary_emb.inv_freq" in name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_checkpoint_tensors(self, weights, self.STACKED_PARAMS, self._skip)

    def checkpoint_tensor_names(self) -> set[str]:
        return expected_checkpoint_names(self, self.STACKED_PARAMS)


def _decoder_layer(config, platform, block_size: int, device, tp: TPGroup) -> LlamaDecoderLayer:
    """A Llama decoder layer of the head (full attention, no biases), on its own KV cache."""
    attn = LlamaAttention(
        config,
        platform,
        block_size=block_size,
        device=device,
        tp=tp,
        qkv_bias=False,
        o_bias=False,
        sliding_window=None,
    )
    return LlamaDecoderLayer(config, platform, attn, device=device, tp=tp)


def check_eagle_head(
    head, target, architecture: str = ARCHITECTURE, fmt: str = "octavo.spec_decode.eagle_head"
) -> None:
    """A head must name ``architecture`` (EagleHead; a Gumiho head is one with more, format
    ``fmt``), have at least one layer and be made for a target of this hidden size and
    vocabulary (``ModelConfig`` of each); else a ConfigError naming what differs."""
    where = "speculative_config.model"
    if head.architecture != architecture or head.num_hidden_layers < 1:
        raise ConfigError(
            f"{where} is not a head of architecture {architecture!r}: its config.json names "
            f"{head.architecture!r} with {head.num_hidden_layers} layer(s); a head is "
            f"{architecture!r} with 1 or more layers (the format: {fmt})"
        )
    for field in ("hidden_size", "vocab_size"):
        if getattr(head, field) != getattr(target, field):
            raise ConfigError(
                f"{where} was made for a target with {field} {getattr(head, field)}, but this "
                f"target has {getattr(target, field)}; train a head for this model"
            )


def head_config(target_config: dict[str, Any], layers: int = 1) -> dict[str, Any]:
    """The ``config.json`` of a head for a target of HF config ``target_config``: the target's
    layer shape, ``layers`` of them, the head's architecture."""
    config = dict(target_config)
    config.update(architectures=[ARCHITECTURE], num_hidden_layers=layers, tie_word_embeddings=False)
    return config


def head_tensor_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Checkpoint name -> shape of every tensor a head of ``config`` (its config.json) holds."""
    hidden, mlp = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    shapes = {"fc.weight": (hidden, 2 * hidden)}
    for i in range(config["num_hidden_layers"]):
        layer = f"layers.{i}."
        shapes.update(
            {
                f"{layer}self_attn.q_proj.weight": (heads * head_dim, hidden),
                f"{layer}self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
                f"{layer}self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
                f"{layer}self_attn.o_proj.weight": (hidden, heads * head_dim),
                f"{layer}mlp.gate_proj.weight": (mlp, hidden),
                f"{layer}mlp.up_proj.weight": (mlp, hidden),
                f"{layer}mlp.down_proj.weight": (hidden, mlp),
                f"{layer}input_layernorm.weight": (hidden,),
                f"{layer}post_attention_layernorm.weight": (hidden,),
            }
        )
    shapes["norm.weight"] = (hidden,)
    return shapes
