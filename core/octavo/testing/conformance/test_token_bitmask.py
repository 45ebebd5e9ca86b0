"""The platform's ``apply_token_bitmask()``: exactly the reference's masking, in place."""

from __future__ import annotations

import pytest
import torch

from octavo.ops import reference
from octavo.testing.conformance import tolerances


def make_inputs(num_rows, num_mask_rows, vocab, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_rows, vocab, generator=generator).to(dtype)
    words = -(-vocab // 32)
    # Full int32 range: bit 31 (the sign bit) must count like any other.
    bitmask = torch.randint(
        -(2**31), 2**31 - 1, (num_mask_rows, words), generator=generator, dtype=torch.int64
    ).to(torch.int32)
    bitmask[0] = -1  # a row allowing everything
    return logits, bitmask


@pytest.mark.parametrize("vocab", (100, 256, 257))
@pytest.mark.parametrize("dtype", tolerances.ALL_DTYPES, ids=str)
def test_bitmask_all_rows(octavo_platform, octavo_device, dtype, vocab):
    """Bitmask row ``i`` masks logits row ``i``; allowed logits are untouched."""
    if dtype != torch.float32:
        tolerances.require_dtype(octavo_platform, dtype)
    logits, bitmask = make_inputs(5, 5, vocab, dtype, seed=vocab)
    expected = logits.clone()
    reference.apply_token_bitmask(expected, bitmask)
    actual = logits.to(octavo_device)
    result = octavo_platform.apply_token_bitmask()(actual, bitmask.to(octavo_device))
    assert result is None, "apply_token_bitmask works in place and returns None"
    assert torch.equal(actual.cpu(), expected)


@pytest.mark.parametrize("vocab", (100, 257))
def test_bitmask_with_indices(octavo_platform, octavo_device, vocab):
    """``indices[i]`` is the logits row bitmask row ``i`` applies to; other rows are untouched."""
    logits, bitmask = make_inputs(6, 3, vocab, torch.float32, seed=7)
    indices = torch.tensor([4, 0, 2], dtype=torch.int32)
    expected = logits.clone()
    reference.apply_token_bitmask(expected, bitmask, indices)
    assert torch.equal(expected[[1, 3, 5]], logits[[1, 3, 5]])
    actual = logits.to(octavo_device)
    apply = octavo_platform.apply_token_bitmask()
    apply(actual, bitmask.to(octavo_device), indices.to(octavo_device))
    assert torch.equal(actual.cpu(), expected)
