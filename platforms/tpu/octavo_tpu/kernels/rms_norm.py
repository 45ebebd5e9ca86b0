"""RMSNorm with the fused residual add, in Pallas: one tile of tokens per grid step.

The arithmetic is HuggingFace Llama's (and ``octavo.ops.reference.rms_norm``'s): the residual
added in the input dtype, the statistics in float32, the product with the weight in the input
dtype.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

TOKEN_TILE = 8  # tokens per grid step (a whole sublane tile of float32)


def _normalise(x, weight_ref, o_ref, eps: float):
    h = x.astype(jnp.float32)
    h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + eps)
    o_ref[...] = (weight_ref[...] * h.astype(x.dtype)).astype(o_ref.dtype)


def _rms_norm_kernel(x_ref, weight_ref, o_ref, *, eps: float):
    _normalise(x_ref[...], weight_ref, o_ref, eps)


def _add_rms_norm_kernel(x_ref, residual_ref, weight_ref, o_ref, sum_ref, *, eps: float):
    x = x_ref[...] + residual_ref[...]
    sum_ref[...] = x
    _normalise(x, weight_ref, o_ref, eps)


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def rms_norm(
    x: jax.Array,
    weight: jax.Array,
    residual: Optional[jax.Array] = None,
    *,
    eps: float,
    interpret: bool = False,
):
    """``rms_norm(x) * weight`` for ``x [T, hidden]``; with ``residual``, the pair
    ``(rms_norm(x + residual) * weight, x + residual)``."""
    num_tokens, hidden = x.shape
    if num_tokens == 0:
        return x if residual is None else (x, x)
    padded = -(-num_tokens // TOKEN_TILE) * TOKEN_TILE
    pad = ((0, padded - num_tokens), (0, 0))
    rows = pl.BlockSpec((TOKEN_TILE, hidden), lambda i: (i, 0))
    weight_spec = pl.BlockSpec((1, hidden), lambda i: (0, 0))
    shape = jax.ShapeDtypeStruct((padded, hidden), x.dtype)
    weight = weight.reshape(1, hidden).astype(x.dtype)
    grid = (padded // TOKEN_TILE,)
    if residual is None:
        out = pl.pallas_call(
            functools.partial(_rms_norm_kernel, eps=eps),
            grid=grid,
            in_specs=[rows, weight_spec],
            out_specs=rows,
            out_shape=shape,
            interpret=interpret,
        )(jnp.pad(x, pad), weight)
        return out[:num_tokens]
    out, summed = pl.pallas_call(
        functools.partial(_add_rms_norm_kernel, eps=eps),
        grid=grid,
        in_specs=[rows, rows, weight_spec],
        out_specs=(rows, rows),
        out_shape=(shape, shape),
        interpret=interpret,
    )(jnp.pad(x, pad), jnp.pad(residual.astype(x.dtype), pad), weight)
    return out[:num_tokens], summed[:num_tokens]
