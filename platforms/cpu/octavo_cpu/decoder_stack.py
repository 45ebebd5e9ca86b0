"""Llama decoder layers and their final norm in one compiled call (csrc/decoder_stack.cpp).

The modules call a dozen compiled kernels per layer from Python; on a small model the
interpreter between them costs as much as the kernels (a one-token step of the demo model: ~3.3
ms, of which ~1.5 ms kernels). ``decoder_stack`` runs the same kernels in the same order on the
same buffers from C++, so its hidden states are bit for bit the modules' (tests/platforms check
it); the model keeps its embedding lookup and rotary tables, once a step.

It applies where the modules would run the compiled kernels throughout: plain Llama layers (no
biases, no per-head q/k norms), float32, one tensor-parallel rank, every linear packed by the
compiled GEMM (not oneDNN's). Anything else, and ``OCTAVO_CPU_DECODER_STACK=0``, runs the
modules.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

import torch

from octavo.models.layers.packed import PackedMatmul
from octavo.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP
from octavo_cpu.attention import CpuAttentionBackend

STACK_ENV = "OCTAVO_CPU_DECODER_STACK"
logger = logging.getLogger(__name__)


class DecoderStack:
    """``fn(hidden, cos_sin, attn_metadata) -> hidden``: the layers and the final norm in one
    ``decoder_stack`` call."""

    def __init__(self, layers: Any, norm: Any, ops: Any):
        spec = layers[0].self_attn.attn.spec
        tensors = [tensor for layer in layers for tensor in _layer_tensors(layer)]
        self._op = ops.decoder_stack.default
        self._weights = [*tensors, norm.weight.detach()]
        self._attention = [layer.self_attn.attn for layer in layers]
        self._shape = (
            spec.num_heads,
            spec.num_kv_heads,
            spec.head_dim,
            layers[0].mlp.gate_up_proj.shard_sizes[0],
            spec.scale,
            -1 if spec.sliding_window is None else spec.sliding_window,
            norm.eps,
        )

    def __call__(self, hidden: torch.Tensor, cos_sin, metadata: Any) -> torch.Tensor:
        cos, sin = cos_sin
        num_tokens = metadata.num_actual_tokens
        return self._op(
            hidden,
            cos,
            sin,
            self._weights,
            self.kv_caches(),
            metadata.slot_mapping,
            metadata.block_table,
            metadata.query_start_loc,
            metadata.seq_lens,
            *self._shape,
            hidden.shape[0] if num_tokens < 0 else num_tokens,
        )

    def kv_caches(self) -> list[torch.Tensor]:
        """The layers' KV caches as they are now (allocated after the stack is made)."""
        return [attention.kv_cache for attention in self._attention]

    def shape_arguments(self) -> tuple[list[int], float, float]:
        """``([num_heads, num_kv_heads, head_dim, intermediate_size, sliding_window], scale,
        eps)``: the stack's shape as an op that runs it from C++ takes it."""
        heads, kv_heads, head_dim, intermediate, scale, window, eps = self._shape
        return [heads, kv_heads, head_dim, intermediate, window], scale, eps

    @property
    def weights(self) -> list[torch.Tensor]:
        """The stack's tensors in the op's order (7 a layer, then the final norm's weight)."""
        return self._weights


def make_decoder_stack(layers: Any, norm: Any, ops: Any) -> Optional[DecoderStack]:
    """The stack of ``layers`` and ``norm``, or None where it does not apply (the reason is
    logged at debug level)."""
    if os.environ.get(STACK_ENV, "1").strip() == "0":
        return None
    why = _unfit(layers, norm, ops)
    if why is not None:
        logger.debug("decoder layers run as modules: %s", why)
        return None
    return DecoderStack(layers, norm, ops)


def _unfit(layers: Any, norm: Any, ops: Any) -> Optional[str]:
    if ops is None or not hasattr(ops, "decoder_stack"):
        return "no compiled decoder_stack kernel"
    if len(layers) == 0:
        return "no decoder layers"
    norms = [norm]
    for layer in layers:
        why = _layer_unfit(layer)
        if why is not None:
            return why
        norms += [layer.input_layernorm, layer.post_attention_layernorm]
    shapes = {(layer.self_attn.attn.spec, layer.mlp.gate_up_proj.shard_sizes) for layer in layers}
    if len(shapes) != 1:
        return "the layers differ in shape or attention window"
    if any(n.weight.dtype != torch.float32 for n in norms):
        return "the stack computes in float32"
    if len({n.eps for n in norms}) != 1:
        return "the norms differ in eps"
    return None


def _layer_unfit(layer: Any) -> Optional[str]:
    attn, mlp = layer.self_attn, layer.mlp
    if (type(layer), type(attn), type(mlp)) != (LlamaDecoderLayer, LlamaAttention, LlamaMLP):
        return f"{type(layer).__name__} is not the plain Llama layer"
    if not isinstance(attn.attn.backend, CpuAttentionBackend) or attn.rotary_embedding is None:
        return "attention or rotary embedding outside the compiled kernels"
    if attn.attn.spec.dtype != torch.float32:
        return "the stack computes in float32"
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
