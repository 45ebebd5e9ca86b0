"""Paged attention: the platform's ``attention_backend(spec).forward`` against the reference."""

from __future__ import annotations

import pytest
import torch

from octavo.platform.types import AttentionSpec
from octavo.testing.conformance import tolerances
from octavo.testing.conformance.paged_batches import run_scenario

# Call 1 prefills fresh prompts (one of a single token, one spanning several 128-token blocks);
# call 2 mixes, in no particular order, decodes with a chunk that continues after 11 tokens of
# context and a new prompt, plus padding tokens; call 3 is decodes only.
MIXED = (
    ((0, 0, 11), (1, 0, 5), (2, 0, 1), (3, 0, 150)),
    ((1, 5, 1), (0, 11, 8), (2, 1, 1), (4, 0, 7), (3, 150, 1)),
    ((0, 19, 1), (1, 6, 1), (2, 2, 1), (3, 151, 1), (4, 7, 1)),
)
MIXED_PADDING = {1: 3}  # call 1 of either scenario ends with 3 padding tokens

# A shorter variant for slow back-ends (--octavo-conformance-quick).
MIXED_QUICK = (
    ((0, 0, 11), (1, 0, 1), (2, 0, 130)),
    ((1, 1, 1), (0, 11, 6), (3, 0, 3), (2, 130, 1)),
)

# (num_heads, num_kv_heads, head_dim): MHA, the stories260K shape, GQA 4, MQA, the ~100M shape,
# and a head size that is not a power of two (kernels that pad heads must mask the tail).
HEAD_SHAPES = ((4, 4, 32), (8, 4, 8), (8, 2, 16), (4, 1, 32), (12, 4, 64), (8, 2, 24))
QUICK_HEAD_SHAPES = HEAD_SHAPES[1:3] + HEAD_SHAPES[-1:]


def make_spec(dtype, block_size, num_heads=4, num_kv_heads=2, head_dim=32, sliding_window=None):
    """A spec whose scale is deliberately not ``head_dim ** -0.5``: kernels must use ``scale``."""
    return AttentionSpec(
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        block_size=block_size,
        scale=1.3 / head_dim**0.5,
        sliding_window=sliding_window,
    )


def check(results, dtype, label):
    for result in results:
        tolerances.assert_close(
            result.actual,
            result.expected,
            tolerances.ATTENTION[dtype],
            f"{label}, {result.description}",
        )


def typical_block_size(platform) -> int:
    """16 (the default) when offered, else the platform's first block size."""
    offered = platform.capabilities.block_sizes
    return 16 if 16 in offered else offered[0]


@pytest.mark.parametrize("block_size", tolerances.BLOCK_SIZES)
@pytest.mark.parametrize("dtype", tolerances.ALL_DTYPES, ids=str)
def test_mixed_prefill_and_decode(
    octavo_platform, octavo_device, octavo_conformance_quick, dtype, block_size
):
    """Ragged batches mixing prefill chunks (with and without context), decodes and padding."""
    tolerances.require_dtype(octavo_platform, dtype)
    tolerances.require_block_size(octavo_platform, block_size)
    if octavo_conformance_quick and block_size == 32:
        pytest.skip("quick run: 16 and 128 cover multi-block tables")
    scenario = MIXED_QUICK if octavo_conformance_quick else MIXED
    spec = make_spec(dtype, block_size)
    results = run_scenario(octavo_platform, spec, scenario, octavo_device, padding=MIXED_PADDING)
    check(results, dtype, f"{dtype} block {block_size}")


@pytest.mark.parametrize("heads", HEAD_SHAPES, ids=lambda h: "h{}kv{}d{}".format(*h))
def test_head_shapes(octavo_platform, octavo_device, octavo_conformance_quick, heads):
    """MHA, GQA and MQA head mappings and head sizes, in float32."""
    num_heads, num_kv_heads, head_dim = heads
    if octavo_conformance_quick and heads not in QUICK_HEAD_SHAPES:
        pytest.skip("quick run")
    block_size = typical_block_size(octavo_platform)
    spec = make_spec(torch.float32, block_size, num_heads, num_kv_heads, head_dim)
    scenario = MIXED_QUICK if octavo_conformance_quick else MIXED
    results = run_scenario(octavo_platform, spec, scenario, octavo_device, seed=1)
    check(results, torch.float32, f"heads {heads}")


@pytest.mark.parametrize("sliding_window", (1, 5, 16))
def test_sliding_window(octavo_platform, octavo_device, octavo_conformance_quick, sliding_window):
    """Each token sees only the last ``sliding_window`` positions, itself included."""
    if octavo_conformance_quick and sliding_window != 5:
        pytest.skip("quick run")
    block_size = typical_block_size(octavo_platform)
    spec = make_spec(torch.float32, block_size, sliding_window=sliding_window)
    scenario = MIXED_QUICK if octavo_conformance_quick else MIXED
    results = run_scenario(octavo_platform, spec, scenario, octavo_device, seed=2)
    check(results, torch.float32, f"sliding window {sliding_window}")


def test_empty_batch(octavo_platform, octavo_device):
    """A call with no requests and no tokens returns an empty output."""
    spec = make_spec(torch.float32, typical_block_size(octavo_platform))
    results = run_scenario(octavo_platform, spec, ((),), octavo_device)
    assert results[0].actual.shape == (0, spec.num_heads, spec.head_dim)


@pytest.mark.parametrize("dtype", tolerances.ALL_DTYPES, ids=str)
def test_single_token(octavo_platform, octavo_device, dtype):
    """A one-token prompt alone, then one decode after a long context, then a lone decode."""
    tolerances.require_dtype(octavo_platform, dtype)
    spec = make_spec(dtype, typical_block_size(octavo_platform))
    scenario = (((0, 0, 1),), ((1, 0, 37),), ((1, 37, 1),), ((0, 1, 1),))
    results = run_scenario(octavo_platform, spec, scenario, octavo_device, seed=3)
    check(results, dtype, f"single token {dtype}")


def test_fused_qkv_slices(octavo_platform, octavo_device):
    """Query, key and value may be column slices of one fused QKV projection's output."""
    spec = make_spec(torch.float32, typical_block_size(octavo_platform))
    results = run_scenario(
        octavo_platform, spec, MIXED_QUICK, octavo_device, seed=4, fused_qkv=True
    )
    check(results, torch.float32, "fused QKV slices")


def test_request_without_new_tokens(octavo_platform, octavo_device):
    """A request may sit in the batch with no new tokens (its rows of ``query_start_loc`` are
    equal); the others are unaffected and nothing is written for it."""
    spec = make_spec(torch.float32, typical_block_size(octavo_platform))
    scenario = (((0, 0, 5), (1, 0, 3)), ((0, 5, 0), (1, 3, 4)), ((1, 7, 1), (0, 5, 1)))
    results = run_scenario(octavo_platform, spec, scenario, octavo_device, seed=5)
    check(results, torch.float32, "request without new tokens")
