"""The platform's ``rotary_embedding((cos, sin), query, key, head_dim)`` against the reference.
Optional for a platform: without its kernel, ``Platform.rotary_embedding`` is the reference."""

from __future__ import annotations

import pytest
import torch

from octavo.models.layers.rotary import RopeConfig, RotaryEmbedding
from octavo.ops import reference
from octavo.testing.conformance import tolerances

# (num_tokens, num_heads, num_kv_heads, head_dim): empty, one decode row, the ~5M benchmark
# model, the ~100M one, stories260K's head_dim 8, a half-width (12) no vector width divides,
# and a wide head.
SHAPES = (
    (0, 4, 2, 32),
    (1, 8, 4, 32),
    (9, 8, 4, 32),
    (5, 12, 4, 64),
    (3, 8, 4, 8),
    (7, 2, 2, 24),
    (17, 4, 1, 128),
)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "t{}h{}kv{}d{}".format(*s))
@pytest.mark.parametrize("dtype", tolerances.ALL_DTYPES, ids=str)
def test_rotary_embedding(octavo_platform, octavo_device, dtype, shape):
    """Query and key as the model makes them (column slices of one qkv projection, so their rows
    are strided) and as plain tensors, at positions up to 4k: the reference's rounding exactly
    (products and sum in the dtype, as transformers computes them)."""
    tolerances.require_dtype(octavo_platform, dtype)
    num_tokens, num_heads, num_kv_heads, head_dim = shape
    generator = torch.Generator().manual_seed(num_tokens * 131 + head_dim)
    rope = RopeConfig(theta=10000.0)
    table = RotaryEmbedding(head_dim, 4096, rope, "cpu")
    positions = torch.randint(0, 4096, (num_tokens,), generator=generator)
    cos_sin = table.cos_sin(positions, dtype)
    q_width, kv_width = num_heads * head_dim, num_kv_heads * head_dim
    qkv = (torch.randn(num_tokens, q_width + 2 * kv_width, generator=generator) * 4).to(dtype)
    query, key = qkv[:, :q_width], qkv[:, q_width : q_width + kv_width]
    expected_q, expected_k = reference.rotary_embedding(cos_sin, query, key, head_dim)
    fn = octavo_platform.rotary_embedding()
    device_cos_sin = tuple(t.to(octavo_device) for t in cos_sin)
    fused = qkv.clone().to(octavo_device)  # copies: a kernel may rotate in place
    for q, k in (
        (fused[:, :q_width], fused[:, q_width : q_width + kv_width]),
        (query.clone().to(octavo_device), key.clone().to(octavo_device)),
    ):
        out_q, out_k = fn(device_cos_sin, q, k, head_dim)
        assert out_q.shape == (num_tokens, num_heads, head_dim)
        assert out_k.shape == (num_tokens, num_kv_heads, head_dim)
        assert out_q.dtype == dtype and out_k.dtype == dtype
        what = f"{dtype} {shape}"
        tolerances.assert_close(out_q, expected_q, tolerances.ROTARY[dtype], f"query {what}")
        tolerances.assert_close(out_k, expected_k, tolerances.ROTARY[dtype], f"key {what}")
    value = qkv[:, q_width + kv_width :]
    assert torch.equal(fused[:, q_width + kv_width :].cpu(), value), "the kernel wrote past key"
