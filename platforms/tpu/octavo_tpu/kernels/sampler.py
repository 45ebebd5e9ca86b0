"""The sampler: greedy, temperature, top-k, top-p and min-p, seeded per request.

The filters' cut-offs need the sorted row, which XLA's sort provides (on TPU as on CPU); the
draw over the whole vocabulary is a Pallas kernel: ``argmax(x - log q)``, ``q ~ Exp(1)``, the
exponential race that ``octavo.ops.reference.sample`` runs as ``argmax(probs / q)`` (the same
winner: ``log`` is monotonic and the softmax's normaliser is the same for the whole row).
Greedy rows race with ``q = 1``, which is the argmax. Ties go to the lowest index; a row with
no finite logit draws -1.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

ROW_TILE = 8  # sampling rows per grid step


def _draw_kernel(x_ref, log_q_ref, o_ref):
    score = x_ref[...] - log_q_ref[...]
    best = score.max(axis=1, keepdims=True)
    index = jax.lax.broadcasted_iota(jnp.int32, score.shape, 1)
    first = jnp.where(score == best, index, score.shape[1]).min(axis=1, keepdims=True)
    o_ref[...] = jnp.where(best == -jnp.inf, -1, first)


def race(x: jax.Array, log_q: jax.Array, *, interpret: bool) -> jax.Array:
    """``[S]`` int32: per row the first index of ``max(x - log_q)`` (-1 when ``x`` has no finite
    value)."""
    num_rows, vocab = x.shape
    padded = -(-num_rows // ROW_TILE) * ROW_TILE
    pad = ((0, padded - num_rows), (0, 0))
    rows = pl.BlockSpec((ROW_TILE, vocab), lambda i: (i, 0))
    out = pl.pallas_call(
        _draw_kernel,
        grid=(padded // ROW_TILE,),
        in_specs=[rows, rows],
        out_specs=pl.BlockSpec((ROW_TILE, 1), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((padded, 1), jnp.int32),
        interpret=interpret,
    )(jnp.pad(x, pad), jnp.pad(log_q, pad))
    return out[:num_rows, 0]


def filter_logits(logits, top_k, top_p, min_p):
    """Mask to -inf what top-k, then top-p, then min-p exclude (ties at a cut-off are kept)."""
    vocab = logits.shape[-1]
    k = jnp.where((top_k <= 0) | (top_k > vocab), vocab, top_k)
    descending = -jnp.sort(-logits, axis=-1)
    kth = jnp.take_along_axis(descending, (k - 1)[:, None], axis=1)
    logits = jnp.where(logits < kth, -jnp.inf, logits)

    descending = jnp.where(descending < kth, -jnp.inf, descending)  # still sorted
    probs = jax.nn.softmax(descending, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = (mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0)
    keep = keep.at[:, 0].set(True)
    last_kept = jnp.sum(keep, axis=-1) - 1
    cut = jnp.take_along_axis(descending, last_kept[:, None], axis=1)
    logits = jnp.where(logits < cut, -jnp.inf, logits)

    probs = jax.nn.softmax(logits, axis=-1)
    threshold = min_p[:, None] * probs.max(axis=-1, keepdims=True)
    return jnp.where(probs < threshold, -jnp.inf, logits)


def exponential_noise(keys: jax.Array, vocab: int) -> jax.Array:
    """``[S, V]`` Exp(1) noise, row ``i`` from key data ``keys[i]`` (``uint32 [2]``) alone, so a
    seeded request draws the same tokens whatever else is in the batch."""
    draw = lambda key: jax.random.exponential(jax.random.wrap_key_data(key), (vocab,))  # noqa: E731
    return jax.vmap(draw)(keys)


@functools.partial(jax.jit, static_argnames=("all_greedy", "interpret"))
def sample(
    logits: jax.Array,  # [S, V]
    temperature: jax.Array,  # [S] float32, 0 = greedy
    top_k: jax.Array,  # [S] int32, 0 = off
    top_p: jax.Array,  # [S] float32, 1 = off
    min_p: jax.Array,  # [S] float32, 0 = off
    keys: jax.Array,  # [S, 2] uint32: each row's PRNG key data
    *,
    all_greedy: bool = False,
    interpret: bool = False,
) -> jax.Array:
    """``[S]`` int32 token ids, one per row of ``logits``."""
    logits = logits.astype(jnp.float32)
    if all_greedy:
        return race(logits, jnp.zeros_like(logits), interpret=interpret)
    greedy = temperature <= 0
    scaled = logits / jnp.where(greedy, 1.0, temperature)[:, None]
    filtered = filter_logits(scaled, top_k, top_p, min_p)
    log_q = jnp.log(exponential_noise(keys, logits.shape[-1]))
    x = jnp.where(greedy[:, None], logits, filtered)
    return race(x, jnp.where(greedy[:, None], 0.0, log_q), interpret=interpret)
