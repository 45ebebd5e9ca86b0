"""The tpu platform's kernels behind the torch-facing hooks: what the conformance suite (and a
torch model built on this platform) calls. Tensors cross to JAX and back through the host; the
JAX runner calls the kernels directly and never comes here."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch

from octavo.model_executor.step_inputs import ragged_index
from octavo.platform.types import AttentionBackend, AttentionMetadata, SamplingMetadata
from octavo_tpu.kernels import attention, rms_norm, sampler

_JAX_DTYPES = {torch.float32: jnp.float32, torch.bfloat16: jnp.bfloat16}


def to_jax(tensor: torch.Tensor) -> jax.Array:
    if tensor.dtype == torch.bfloat16:  # numpy has no bfloat16: cross as its bits
        bits = tensor.detach().contiguous().view(torch.int16).cpu().numpy()
        return jax.lax.bitcast_convert_type(jnp.asarray(bits), jnp.bfloat16)
    return jnp.asarray(tensor.detach().contiguous().cpu().numpy())


def to_torch(array: jax.Array) -> torch.Tensor:
    if array.dtype == jnp.bfloat16:
        bits = np.asarray(jax.lax.bitcast_convert_type(array, jnp.int16))
        return torch.from_numpy(bits.copy()).view(torch.bfloat16)
    return torch.from_numpy(np.array(array))


def context_per_token(metadata: AttentionMetadata, num_tokens: int):
    """``(token_rows, context_lens)`` for the kernel: each token's request row and how many
    positions it sees (its own included); 0 for padding tokens."""
    query_start_loc = metadata.query_start_loc.cpu().numpy().astype(np.int64)
    seq_lens = metadata.seq_lens.cpu().numpy().astype(np.int64)
    num_scheduled = np.diff(query_start_loc)
    rows, offsets = ragged_index(num_scheduled)
    context = seq_lens[rows] - num_scheduled[rows] + offsets + 1
    token_rows = np.zeros(num_tokens, np.int32)
    context_lens = np.zeros(num_tokens, np.int32)
    token_rows[: len(rows)], context_lens[: len(rows)] = rows, context
    return token_rows, context_lens


class PallasAttentionBackend(AttentionBackend):
    """The Pallas paged attention, its KV layout ``[2, num_blocks, num_kv_heads, block_size,
    head_dim]`` (blocks on dimension 1, so the base class's block copies apply)."""

    name = "pallas"

    def __init__(self, spec, interpret: bool):
        super().__init__(spec)
        self.interpret = interpret

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        s = self.spec
        return attention.kv_cache_shape(num_blocks, s.block_size, s.num_kv_heads, s.head_dim)

    def forward(self, query, key, value, kv_cache, metadata: AttentionMetadata):
        s = self.spec
        num_tokens = query.shape[0]
        q = query.reshape(num_tokens, s.num_heads, s.head_dim)
        k = key.reshape(num_tokens, s.num_kv_heads, s.head_dim)
        v = value.reshape(num_tokens, s.num_kv_heads, s.head_dim)
        actual = metadata.num_actual_tokens
        slots = np.full(num_tokens, kv_cache.shape[1] * s.block_size, np.int32)  # padding: dropped
        slots[:actual] = metadata.slot_mapping[:actual].cpu().numpy()
        cache = attention.write_kv(to_jax(kv_cache), to_jax(k), to_jax(v), jnp.asarray(slots))
        kv_cache.copy_(to_torch(cache))
        if num_tokens == 0 or metadata.block_table.shape[0] == 0:
            return query.new_zeros(num_tokens, s.num_heads, s.head_dim)
        token_rows, context_lens = context_per_token(metadata, num_tokens)
        out = attention.paged_attention(
            to_jax(q),
            cache,
            jnp.asarray(token_rows),
            jnp.asarray(context_lens),
            to_jax(metadata.block_table.to(torch.int32)),
            scale=s.scale,
            window=s.sliding_window,
            interpret=self.interpret,
        )
        return to_torch(out).to(query.device)


def make_rms_norm(eps: float, interpret: bool):
    """``fn(x, weight, residual=None)`` over the Pallas RMSNorm (the hook's contract)."""

    def fn(x: torch.Tensor, weight: torch.Tensor, residual=None):
        shape = x.shape
        x2 = to_jax(x.reshape(-1, shape[-1]))
        if residual is None:
            out = rms_norm.rms_norm(x2, to_jax(weight), eps=eps, interpret=interpret)
            return to_torch(out).view(shape)
        out, summed = rms_norm.rms_norm(
            x2,
            to_jax(weight),
            to_jax(residual.reshape(-1, shape[-1])),
            eps=eps,
            interpret=interpret,
        )
        return to_torch(out).view(shape), to_torch(summed).view(shape)

    return fn


def row_keys(metadata: SamplingMetadata, num_rows: int) -> np.ndarray:
    """``[R, 2]`` uint32 PRNG key data: a seeded row's from its generator (two words, which
    advances it: the next draw differs, the same seed repeats the stream), the others from
    torch's global generator (two words for the call, the row's index added)."""
    words = torch.randint(0, 2**32, (2,), dtype=torch.int64).numpy()
    keys = np.empty((num_rows, 2), np.uint32)
    keys[:, 0] = words[0]
    keys[:, 1] = (words[1] + np.arange(num_rows)) % 2**32
    for row, generator in metadata.generators.items():
        keys[row] = torch.randint(0, 2**32, (2,), dtype=torch.int64, generator=generator).numpy()
    return keys


def make_sampler(interpret: bool):
    """``fn(logits, metadata) -> token ids`` (int64 on the logits' device) over the JAX
    sampler."""

    def fn(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        num_rows = logits.shape[0]
        if num_rows == 0:
            return torch.zeros(0, dtype=torch.int64, device=logits.device)
        tokens = sampler.sample(
            to_jax(logits.float()),
            to_jax(metadata.temperature.float()),
            to_jax(metadata.top_k.to(torch.int32)),
            to_jax(metadata.top_p.float()),
            to_jax(metadata.min_p.float()),
            jnp.asarray(row_keys(metadata, num_rows)),
            all_greedy=bool(metadata.all_greedy),
            interpret=interpret,
        )
        return torch.from_numpy(np.asarray(tokens).astype(np.int64)).to(logits.device)

    return fn
