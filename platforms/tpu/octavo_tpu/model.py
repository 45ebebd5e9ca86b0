"""The Llama family (Llama, Mistral, Qwen2, Qwen3) in JAX over the paged KV cache.

The weights are the ones the core's loader reads from the checkpoint (same names, same fused
``qkv_proj``/``gate_up_proj``, same family differences: biases, Qwen3's q/k norms, sliding
windows, tied embeddings, RoPE tables), taken from the torch model it builds on the host and
placed on the JAX device once at start-up. The forward is pure: ``(params, kv_caches, step) ->
(hidden_states, kv_caches)``, jitted by the runner per token bucket with the caches donated.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp

from octavo.errors import ConfigError
from octavo.models.llama import LlamaMLP
from octavo_tpu.bridge import to_jax
from octavo_tpu.kernels.attention import paged_attention, write_kv
from octavo_tpu.kernels.rms_norm import rms_norm


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What the forward needs to know statically (hashable: part of the jit's key)."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    scale: float
    windows: tuple[Optional[int], ...]  # per layer
    qk_norm: bool
    precision: Any  # jax.lax.Precision of the matmuls (HIGHEST for float32)
    interpret: bool


@dataclasses.dataclass(frozen=True)
class StepArrays:
    """One step's inputs on the device, padded to the token bucket ``T``."""

    input_ids: jax.Array  # [T] int32
    positions: jax.Array  # [T] int32
    slot_mapping: jax.Array  # [T] int32; padding: past the cache (dropped)
    token_rows: jax.Array  # [T] int32: the token's row of block_table
    context_lens: jax.Array  # [T] int32: position + 1; padding: 0
    block_table: jax.Array  # [R, B] int32


jax.tree_util.register_dataclass(
    StepArrays,
    data_fields=[f.name for f in dataclasses.fields(StepArrays)],
    meta_fields=[],
)


def _optional(tensor) -> Optional[jax.Array]:
    return None if tensor is None else to_jax(tensor)


def params_from_torch(model, interpret: bool) -> tuple[ModelShape, dict]:
    """The static shape and the weights (a pytree of JAX arrays) of a loaded Llama-family torch
    model (``octavo.models.llama.LlamaForCausalLM`` and subclasses)."""
    layers = []
    first = model.model.layers[0].self_attn
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if not isinstance(mlp, LlamaMLP) or not hasattr(attn, "qkv_proj"):
            raise ConfigError(
                f"the tpu platform's runner serves dense Llama-family models; "
                f"{type(model).__name__} has {type(mlp).__name__} blocks and "
                f"{type(attn).__name__} (Mixture of Experts or latent attention): "
                "serve it on another platform (--device cpu, cuda or rocm)"
            )
        entry = {
            "input_norm": to_jax(layer.input_layernorm.weight),
            "post_norm": to_jax(layer.post_attention_layernorm.weight),
            "qkv_w": to_jax(attn.qkv_proj.weight),
            "qkv_b": _optional(attn.qkv_proj.bias),
            "o_w": to_jax(attn.o_proj.weight),
            "o_b": _optional(attn.o_proj.bias),
            "gate_up_w": to_jax(mlp.gate_up_proj.weight),
            "gate_up_b": _optional(mlp.gate_up_proj.bias),
            "down_w": to_jax(mlp.down_proj.weight),
            "down_b": _optional(mlp.down_proj.bias),
        }
        if hasattr(attn, "q_norm"):
            entry["q_norm"] = to_jax(attn.q_norm.weight)
            entry["k_norm"] = to_jax(attn.k_norm.weight)
        layers.append(entry)
    rotary = model.model.rotary_emb
    params = {
        "embed": to_jax(model.model.embed_tokens.weight),
        "layers": layers,
        "norm": to_jax(model.model.norm.weight),
        "lm_head": to_jax(model.lm_head.weight),
        "cos": to_jax(rotary.cos_cache),
        "sin": to_jax(rotary.sin_cache),
    }
    spec = first.attn.spec
    dtype = model.model.embed_tokens.weight.dtype
    shape = ModelShape(
        num_layers=len(layers),
        num_heads=spec.num_heads,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        eps=model.model.norm.eps,
        scale=spec.scale,
        windows=tuple(layer.self_attn.attn.spec.sliding_window for layer in model.model.layers),
        qk_norm="q_norm" in layers[0],
        precision=jax.lax.Precision.HIGHEST if str(dtype) == "torch.float32" else None,
        interpret=interpret,
    )
    return shape, params


def _linear(x, weight, bias, precision):
    out = jnp.dot(x, weight.T, precision=precision, preferred_element_type=jnp.float32)
    return (out if bias is None else out + bias).astype(x.dtype)


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = jnp.concatenate((-x[..., half:], x[..., :half]), axis=-1)
    return x * cos + rotated * sin


def _attention(shape: ModelShape, layer: dict, index: int, hidden, cos_sin, kv_cache, step):
    num_tokens = hidden.shape[0]
    h, kvh, d = shape.num_heads, shape.num_kv_heads, shape.head_dim
    qkv = _linear(hidden, layer["qkv_w"], layer["qkv_b"], shape.precision)
    q, k, v = jnp.split(qkv, (h * d, (h + kvh) * d), axis=-1)
    if shape.qk_norm:
        q = rms_norm(q.reshape(-1, d), layer["q_norm"], eps=shape.eps, interpret=shape.interpret)
        k = rms_norm(k.reshape(-1, d), layer["k_norm"], eps=shape.eps, interpret=shape.interpret)
    cos, sin = cos_sin
    q = _rotate(q.reshape(num_tokens, h, d), cos, sin)
    k = _rotate(k.reshape(num_tokens, kvh, d), cos, sin)
    v = v.reshape(num_tokens, kvh, d)
    kv_cache = write_kv(kv_cache, k, v, step.slot_mapping)
    out = paged_attention(
        q,
        kv_cache,
        step.token_rows,
        step.context_lens,
        step.block_table,
        scale=shape.scale,
        window=shape.windows[index],
        interpret=shape.interpret,
    )
    return _linear(out.reshape(num_tokens, h * d), layer["o_w"], layer["o_b"], shape.precision), (
        kv_cache
    )


def _mlp(shape: ModelShape, layer: dict, hidden):
    gate, up = jnp.split(
        _linear(hidden, layer["gate_up_w"], layer["gate_up_b"], shape.precision), 2, axis=-1
    )
    return _linear(jax.nn.silu(gate) * up, layer["down_w"], layer["down_b"], shape.precision)


def forward(shape: ModelShape, params: dict, kv_caches: list, step: StepArrays):
    """``(hidden_states [T, hidden], kv_caches)``: the decoder stack over one flat step, each
    layer writing its new K/V into its cache and attending through the block table."""
    hidden = params["embed"][step.input_ids]
    dtype = hidden.dtype
    cos = params["cos"][step.positions].astype(dtype)[:, None, :]
    sin = params["sin"][step.positions].astype(dtype)[:, None, :]
    residual = None
    new_caches = []
    eps, interpret = shape.eps, shape.interpret
    for index, layer in enumerate(params["layers"]):
        if residual is None:
            residual = hidden
            hidden = rms_norm(hidden, layer["input_norm"], eps=eps, interpret=interpret)
        else:
            hidden, residual = rms_norm(
                hidden, layer["input_norm"], residual, eps=eps, interpret=interpret
            )
        hidden, cache = _attention(shape, layer, index, hidden, (cos, sin), kv_caches[index], step)
        new_caches.append(cache)
        hidden, residual = rms_norm(
            hidden, layer["post_norm"], residual, eps=eps, interpret=interpret
        )
        hidden = _mlp(shape, layer, hidden)
    hidden, _ = rms_norm(hidden, params["norm"], residual, eps=eps, interpret=interpret)
    return hidden, new_caches


def compute_logits(shape: ModelShape, lm_head: jax.Array, hidden, logits_indices):
    """``[S, V]`` float32 logits of the tokens at ``logits_indices``."""
    selected = hidden[logits_indices]
    logits = jnp.dot(selected, lm_head.T, precision=shape.precision)
    return logits.astype(jnp.float32)
