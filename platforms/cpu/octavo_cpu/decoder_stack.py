"""Llama decoder layers and their final norm in one compiled call (csrc/decoder_stack.cpp).

The modules call a dozen compiled kernels per layer from Python; on a small model the
interpreter between them costs as much as the kernels (a one-token step of the demo model: ~3.3
ms, of which ~1.5 ms kernels). ``decoder_stack`` runs the same kernels in the same order on the
same buffers from C++, so its hidden states are bit for bit the modules' (tests/platforms check
it); the model keeps its embedding lookup and rotary tables, once a step.

It applies where the modules would run the compiled kernels throughout: Llama-family layers
(Llama, Mistral, Qwen2's q/k/v biases, Qwen3's per-head q/k norms) in float32 or bfloat16, one
tensor-parallel rank, every linear packed by the compiled GEMM (not oneDNN's) or kept quantized
for the compiled quantized GEMM. Anything else, and ``OCTAVO_CPU_DECODER_STACK=0``, runs the
modules; why is logged at start-up.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

import torch

from octavo.models.layers.packed import PackedMatmul
from octavo.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP
from octavo.models.qwen3 import Qwen3Attention
from octavo.quantization.quantized_linear import QuantizedMatmul
from octavo_cpu.attention import CpuAttentionBackend
from octavo_cpu.quantized_gemm import KERNEL_TYPES

FLOAT_GEMM = -1  # decoder_stack's linear type of a weight packed for the float GEMM
STACK_DTYPES = (torch.float32, torch.bfloat16)

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
        self._linear_types = [t for layer in layers for t in _linear_types(layer)]
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
        heads, kv_heads, head_dim, intermediate, scale, window, eps = self._shape
        shape = [heads, kv_heads, head_dim, intermediate, window, *self._linear_types]
        self._shape_arguments = (shape, scale, eps)  # made once: a draft step passes it

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
            self._linear_types,
            *self._shape,
            hidden.shape[0] if num_tokens < 0 else num_tokens,
        )

    def kv_caches(self) -> list[torch.Tensor]:
        """The layers' KV caches as they are now (allocated after the stack is made)."""
        return [attention.kv_cache for attention in self._attention]

    def shape_arguments(self) -> tuple[list[int], float, float]:
        """``([num_heads, num_kv_heads, head_dim, intermediate_size, sliding_window,
        *linear_types], scale, eps)``: the stack's shape and its projections' kernels as an op
        that runs it from C++ takes them."""
        return self._shape_arguments

    @property
    def weights(self) -> list[torch.Tensor]:
        """The stack's tensors in the op's order (10 a layer, then the final norm's weight)."""
        return self._weights


def make_decoder_stack(layers: Any, norm: Any, ops: Any) -> Optional[DecoderStack]:
    """The stack of ``layers`` and ``norm``, or None where it does not apply (the reason is
    logged at debug level)."""
    if os.environ.get(STACK_ENV, "1").strip() == "0":
        return None
    why = _unfit(layers, norm, ops)
    if why is not None:
        logger.info("decoder layers run as Python modules, not the compiled stack: %s", why)
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
    dtypes = {n.weight.dtype for n in norms} | {layer.self_attn.attn.spec.dtype for layer in layers}
    if len(dtypes) != 1 or not dtypes <= set(STACK_DTYPES):
        return f"the stack computes in float32 or bfloat16, not {sorted(map(str, dtypes))}"
    norms += [n for layer in layers for n in _qk_norms(layer)]
    if len({n.eps for n in norms}) != 1:
        return "the norms differ in eps"
    return None


def _layer_unfit(layer: Any) -> Optional[str]:
    attn, mlp = layer.self_attn, layer.mlp
    if type(layer) is not LlamaDecoderLayer or type(mlp) is not LlamaMLP:
        return f"{type(layer).__name__} is not a Llama-family layer"
    if type(attn) not in (LlamaAttention, Qwen3Attention):
        return f"{type(attn).__name__} is not Llama's or Qwen3's attention"
    if not isinstance(attn.attn.backend, CpuAttentionBackend) or attn.rotary_embedding is None:
        return "attention or rotary embedding outside the compiled kernels"
    if attn.o_proj.tp.size != 1:
        return "tensor parallelism"
    for linear in (attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
        if linear.bias is not None:
            return "a bias on the output or MLP projections"
    for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
        method = linear.quant_method
        if isinstance(method, QuantizedMatmul):
            if method.quant_type not in KERNEL_TYPES:
                return f"a {method.quant_type} projection without a compiled kernel"
        elif not isinstance(method, PackedMatmul):
            return "a projection not packed for the compiled GEMM"
    if any(getattr(p, "packed", None) is None for p in _products(layer)):
        return "a projection packed by another GEMM (oneDNN's)"
    return None


def _qk_norms(layer: Any) -> list[Any]:
    attn = layer.self_attn
    return [attn.q_norm, attn.k_norm] if isinstance(attn, Qwen3Attention) else []


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
    """A layer's 10 tensors in decoder_stack's order (an absent one empty)."""
    qkv, o, gate, up, down = (product.packed for product in _products(layer))
    attn = layer.self_attn
    absent = torch.empty(0)
    bias = attn.qkv_proj.bias
    q_norm, k_norm = [n.weight.detach() for n in _qk_norms(layer)] or [absent, absent]
    return [
        layer.input_layernorm.weight.detach(),
        qkv,
        absent if bias is None else bias.detach(),
        q_norm,
        k_norm,
        o,
        layer.post_attention_layernorm.weight.detach(),
        gate,
        up,
        down,
    ]


def _linear_types(layer: Any) -> list[int]:
    """decoder_stack's kernel for each of the layer's qkv, o, gate, up and down projections."""
    attn, mlp = layer.self_attn, layer.mlp
    methods = [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.gate_up_proj, mlp.down_proj]
    return [
        KERNEL_TYPES[m.quant_method.quant_type]
        if isinstance(m.quant_method, QuantizedMatmul)
        else FLOAT_GEMM
        for m in methods
    ]
