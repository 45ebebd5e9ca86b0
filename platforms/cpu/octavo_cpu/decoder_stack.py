"""The eager forward of a Llama-family model as one compiled call per step (csrc/decoder_stack.cpp).

The model's modules call a dozen compiled kernels per layer from Python; on a small model the
interpreter between them costs as much as the kernels (a one-token step of the demo model: ~3 ms,
of which ~1.5 ms kernels). ``decoder_stack`` runs the same kernels in the same order on the same
buffers from C++, so its hidden states are bit for bit the modules' (tests/platforms/cpu check it).
Python keeps the embedding lookup and the rotary tables, once a step.

It applies where the modules would run the compiled kernels throughout: the plain Llama layer
(no biases, no per-head q/k norms), float32, one tensor-parallel rank, every linear packed by the
compiled GEMM (not oneDNN's). Anything else, and ``OCTAVO_CPU_DECODER_STACK=0``, runs the
modules.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

import torch
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from octavo.models.layers.packed import PackedMatmul
from octavo.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
)
from octavo_cpu.attention import CpuAttentionBackend

STACK_ENV = "OCTAVO_CPU_DECODER_STACK"
logger = logging.getLogger(__name__)


class DecoderStackForward:
    """``forward(input_ids, positions, attn_metadata) -> hidden_states`` as the model's own, the
    decoder layers and the final norm in one ``decoder_stack`` call."""

    compiled = False

    def __init__(self, model: LlamaForCausalLM, ops: Any, weights: list[torch.Tensor]):
        inner = model.model
        first = inner.layers[0]
        spec = first.self_attn.attn.spec
        self.model = model
        self._op = ops.decoder_stack.default
        self._weights = weights
        self._attention = [layer.self_attn.attn for layer in inner.layers]
        self._shape = (
            spec.num_heads,
            spec.num_kv_heads,
            spec.head_dim,
            first.mlp.gate_up_proj.shard_sizes[0],
            spec.scale,
            first.self_attn.attn.backend._window,
            inner.norm.eps,
        )

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: Any):
        if is_in_torch_dispatch_mode():
            # A mode sees each op dispatched from Python, not the stack's own allocations: the
            # start-up profile run's memory counter (octavo.model_executor.memory) measures the
            # modules' peak, about the stack's (the same tensors, freed at about the same points).
            return self.model(input_ids, positions, metadata)
        kv_caches = [attention.kv_cache for attention in self._attention]
        inner = self.model.model
        hidden = inner.embed_tokens(input_ids)
        cos, sin = inner.rotary_emb.cos_sin(positions, hidden.dtype)
        num_tokens = metadata.num_actual_tokens
        return self._op(
            hidden,
            cos,
            sin,
            self._weights,
            kv_caches,
            metadata.slot_mapping,
            metadata.block_table,
            metadata.query_start_loc,
            metadata.seq_lens,
            *self._shape,
            input_ids.shape[0] if num_tokens < 0 else num_tokens,
        )


def decoder_stack_forward(model: Any, ops: Any) -> Optional[DecoderStackForward]:
    """The model's forward as one ``decoder_stack`` call, or None where it does not apply (the
    reason is logged at debug level)."""
    if os.environ.get(STACK_ENV, "1").strip() == "0":
        return None
    why = _unfit(model, ops)
    if why is not None:
        logger.debug("the model's layers run as modules: %s", why)
        return None
    weights = [tensor for layer in model.model.layers for tensor in _layer_tensors(layer)]
    return DecoderStackForward(model, ops, [*weights, model.model.norm.weight.detach()])


def _unfit(model: Any, ops: Any) -> Optional[str]:
    if ops is None or not hasattr(ops, "decoder_stack"):
        return "no compiled decoder_stack kernel"
    if not isinstance(model, LlamaForCausalLM) or type(model.model) is not LlamaModel:
        return f"{type(model).__name__} is not a Llama-family model"
    if model.config.dtype != torch.float32:
        return f"the model computes in {model.config.dtype}, the stack in float32"
    if not model.model.layers:
        return "no decoder layers"
    norms = [model.model.norm]
    for layer in model.model.layers:
        why = _layer_unfit(layer)
        if why is not None:
            return why
        norms += [layer.input_layernorm, layer.post_attention_layernorm]
    if len({norm.eps for norm in norms}) != 1:
        return "the norms differ in eps"
    return None


def _layer_unfit(layer: Any) -> Optional[str]:
    attn, mlp = layer.self_attn, layer.mlp
    if (type(layer), type(attn), type(mlp)) != (LlamaDecoderLayer, LlamaAttention, LlamaMLP):
        return f"{type(layer).__name__} is not the plain Llama layer"
    if not isinstance(attn.attn.backend, CpuAttentionBackend) or attn.rotary_embedding is None:
        return "attention or rotary embedding outside the compiled kernels"
    if attn.o_proj.tp.size != 1:
        return "tensor parallelism"
    for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
        if linear.bias is not None:
            return "a projection with a bias"
        method = linear.quant_method
        if not isinstance(method, PackedMatmul) or method.widened:
            return "a projection not packed for the compiled GEMM"
    if any(getattr(p, "packed", None) is None for p in _products(layer)):
        return "a projection packed by another GEMM"
    return None


def _products(layer: Any) -> list[Any]:
    """The packed products of the qkv, output, gate, up and down projections."""
    attn, mlp = layer.self_attn, layer.mlp
    gate_up = mlp.gate_up_proj
    gate, up = zip(gate_up.shard_offsets, gate_up.shard_sizes)
    return [
        attn.qkv_proj.quant_method.product_for(0, attn.qkv_proj.weight.shape[0]),
        attn.o_proj.quant_method.product_for(0, attn.o_proj.weight.shape[0]),
        gate_up.quant_method.product_for(*gate),
        gate_up.quant_method.product_for(*up),
        mlp.down_proj.quant_method.product_for(0, mlp.down_proj.weight.shape[0]),
    ]


def _layer_tensors(layer: Any) -> list[torch.Tensor]:
    """A layer's 7 tensors in decoder_stack's order."""
    qkv, o, gate, up, down = (product.packed for product in _products(layer))
    return [
        layer.input_layernorm.weight.detach(),
        qkv,
        o,
        layer.post_attention_layernorm.weight.detach(),
        gate,
        up,
        down,
    ]
