"""Rotary embeddings against transformers, and the rope configurations octavo accepts."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from octavo.errors import ConfigError
from octavo.models.layers.rotary import (
    RopeConfig,
    RotaryEmbedding,
    inverse_frequencies,
    parse_rope_config,
)
from octavo.ops import reference

HEAD_DIM = 32
SCALINGS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    },
}


def hf_rotary(scaling) -> LlamaRotaryEmbedding:
    rope = (
        {"rope_type": "default", "rope_theta": 500000.0}
        if scaling is None
        else {**scaling, "rope_theta": 500000.0}
    )
    config = LlamaConfig(
        hidden_size=HEAD_DIM * 4,
        num_attention_heads=4,
        max_position_embeddings=2048,
        rope_parameters=rope,
    )
    return LlamaRotaryEmbedding(config)


@pytest.mark.parametrize("kind", SCALINGS)
def test_inverse_frequencies_equal_transformers(kind):
    hf = hf_rotary(SCALINGS[kind])
    hf_dict = {"rope_parameters": {**(SCALINGS[kind] or {}), "rope_theta": 500000.0}}
    assert torch.equal(inverse_frequencies(parse_rope_config(hf_dict), HEAD_DIM), hf.inv_freq)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", SCALINGS)
def test_rotation_equals_transformers_bit_for_bit(kind, dtype):
    hf = hf_rotary(SCALINGS[kind])
    rope = parse_rope_config(
        {"rope_parameters": {**(SCALINGS[kind] or {}), "rope_theta": 500000.0}}
    )
    ours = RotaryEmbedding(HEAD_DIM, 2048, rope, "cpu")
    generator = torch.Generator().manual_seed(0)
    positions = torch.randint(0, 2048, (13,), generator=generator)
    q = torch.randn(13, 4 * HEAD_DIM, generator=generator).to(dtype)
    k = torch.randn(13, 2 * HEAD_DIM, generator=generator).to(dtype)
    q_rot, k_rot = reference.rotary_embedding(ours.cos_sin(positions, dtype), q, k, HEAD_DIM)
    cos, sin = hf(q, positions[None])  # [1, T, D]
    hf_q, hf_k = apply_rotary_pos_emb(
        q.view(1, 13, 4, HEAD_DIM).transpose(1, 2),
        k.view(1, 13, 2, HEAD_DIM).transpose(1, 2),
        cos,
        sin,
    )
    assert torch.equal(q_rot, hf_q.transpose(1, 2)[0]) and torch.equal(
        k_rot, hf_k.transpose(1, 2)[0]
    )


def test_both_config_formats_read_the_same():
    new = {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}}
    old = {"rope_theta": 1e6, "rope_scaling": {"type": "linear", "factor": 2.0}}
    assert parse_rope_config(new) == parse_rope_config(old) == RopeConfig("linear", 1e6, factor=2.0)
    assert parse_rope_config({"rope_theta": 5e5, "rope_scaling": None}) == RopeConfig(
        "default", 5e5
    )
    assert parse_rope_config({}) == RopeConfig("default", 10000.0)


@pytest.mark.parametrize("kind", ["dynamic", "longrope"])
def test_unsupported_scaling_types_are_refused(kind):
    with pytest.raises(
        ConfigError,
        match=f"'{kind}' is not supported; supported types: default, linear, llama3, yarn",
    ):
        parse_rope_config({"rope_scaling": {"rope_type": kind, "factor": 2.0}})


def test_llama3_needs_its_original_context():
    with pytest.raises(ConfigError, match="original_max_position_embeddings"):
        parse_rope_config({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}})


def test_gemma3_reads_both_rope_formats():
    """Gemma 3's per-layer-type RoPE from transformers 5's ``rope_parameters`` and from the
    transformers 4 configs on the Hub (``rope_theta`` + ``rope_scaling`` for the full layers,
    ``rope_local_base_freq`` for the sliding ones)."""
    from octavo.models.gemma3 import gemma3_rope
    from octavo.models.layers.rotary import RopeConfig

    v4 = {"rope_theta": 1e6, "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    v4["rope_local_base_freq"] = 10000.0
    v5 = {
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        }
    }
    for hf in (v4, v5):
        assert gemma3_rope(hf, "full_attention") == RopeConfig("linear", 1e6, factor=8.0)
        assert gemma3_rope(hf, "sliding_attention") == RopeConfig("default", 10000.0)


@pytest.mark.parametrize(
    "params",
    [
        dict(factor=4.0, original_max_position_embeddings=64, mscale=1.0, mscale_all_dim=1.0),
        dict(factor=40.0, original_max_position_embeddings=4096, beta_fast=16, beta_slow=2),
        dict(factor=8.0, original_max_position_embeddings=128, truncate=False),
    ],
    ids=["deepseek-tiny", "deepseek-v3-like", "untruncated"],
)
def test_yarn_matches_transformers(params):
    """YaRN's inverse frequencies and cos/sin factor equal transformers' for the same config."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from octavo.models.layers.rotary import inverse_frequencies, parse_rope_config

    rope = {"rope_type": "yarn", "rope_theta": 10000.0, **params}
    config = transformers.LlamaConfig(
        hidden_size=64,
        num_attention_heads=2,
        head_dim=32,
        rope_parameters=dict(rope),
        max_position_embeddings=params["original_max_position_embeddings"] * 2,
    )
    want, want_factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    ours = parse_rope_config({"rope_parameters": rope})
    torch.testing.assert_close(inverse_frequencies(ours, 32), want, rtol=1e-6, atol=0)
    assert ours.cos_sin_factor == pytest.approx(want_factor)
