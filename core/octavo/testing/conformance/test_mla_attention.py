"""The platform's multi-head latent attention backend (``Platform.mla_attention_backend``)
against attention written out densely per request: a prefill in two chunks, then decodes
beside a new prompt, on one paged cache of ``[latent, rotary key]`` rows. Optional for a
platform: without its backend the core's reference serves."""

from __future__ import annotations

import pytest
import torch

from octavo.platform.types import MLASpec
from octavo.testing.conformance import tolerances
from octavo.testing.conformance.paged_batches import (
    allocate_block_tables,
    build_metadata,
    metadata_to,
)

# (heads, kv_lora_rank, qk_rope_head_dim, block_size): a tiny model's, widths no vector width
# divides, DeepSeek-V3's per-rank shape at a small head count.
SHAPES = ((4, 32, 8, 16), (3, 20, 6, 1), (2, 512, 64, 16))
# Calls in order: (request, num_computed_tokens, num_new_tokens) chunks.
CALLS = (((0, 0, 11), (1, 0, 5)), ((0, 11, 9), (1, 5, 1)), ((1, 6, 1), (2, 0, 7), (0, 20, 1)))


def dense_attention(query, rows, scale, latent_dim):
    """One request's new tokens (the last ``len(query)`` positions) over all its rows."""
    scores = torch.einsum("qhd,kd->hqk", query.float(), rows.float()) * scale
    new, total = query.shape[0], rows.shape[0]
    masked = torch.arange(total)[None, :] > torch.arange(total - new, total)[:, None]
    probs = torch.softmax(scores.masked_fill(masked, float("-inf")), dim=-1)
    return torch.einsum("hqk,kd->qhd", probs, rows[:, :latent_dim].float())


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "h{}l{}r{}b{}".format(*s))
@pytest.mark.parametrize("dtype", tolerances.ALL_DTYPES, ids=str)
def test_mla_attention_matches_dense_attention(octavo_platform, octavo_device, dtype, shape):
    tolerances.require_dtype(octavo_platform, dtype)
    heads, latent, rope, block_size = shape
    if block_size not in octavo_platform.capabilities.block_sizes:
        pytest.skip(f"block size {block_size} is not offered by {octavo_platform.name}")
    spec = MLASpec(heads, latent, rope, dtype, block_size, scale=(latent + rope) ** -0.5)
    backend = octavo_platform.mla_attention_backend(spec)
    generator = torch.Generator().manual_seed(latent + heads)
    final = {0: 21, 1: 7, 2: 7}
    tables, num_blocks = allocate_block_tables(list(final.values()), block_size, generator)
    shape_ = backend.kv_cache_shape(num_blocks)
    assert shape_ == (num_blocks, block_size, latent + rope), "the cache is one row per token"
    cache = torch.randn(shape_, generator=generator).to(dtype).to(octavo_device)
    rows = {
        r: torch.randn(n, latent + rope, generator=generator).to(dtype) for r, n in final.items()
    }
    for call in CALLS:
        metadata = build_metadata(call, tables, block_size)
        queries = [
            torch.randn(n, heads, latent + rope, generator=generator).to(dtype) for *_, n in call
        ]
        new_rows = torch.cat([rows[r][c : c + n] for r, c, n in call])
        out = backend.forward(
            torch.cat(queries).to(octavo_device),
            new_rows.to(octavo_device),
            cache,
            metadata_to(metadata, octavo_device),
        )
        assert out.dtype == dtype and tuple(out.shape) == (new_rows.shape[0], heads, latent)
        start = 0
        for (r, c, n), query in zip(call, queries):
            want = dense_attention(query, rows[r][: c + n], spec.scale, latent)
            tolerances.assert_close(
                out[start : start + n], want, tolerances.ATTENTION[dtype], f"{shape} {call}"
            )
            start += n
