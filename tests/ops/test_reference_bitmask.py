"""octavo.ops.reference.apply_token_bitmask against a bit-by-bit check in plain Python."""

from __future__ import annotations

import pytest
import torch

from octavo.ops import reference


def python_allowed(word: int, bit: int) -> bool:
    return bool(((word & 0xFFFFFFFF) >> bit) & 1)


def make(num_rows, num_mask_rows, vocab, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_rows, vocab, generator=gen)
    bitmask = torch.randint(
        -(2**31), 2**31 - 1, (num_mask_rows, -(-vocab // 32)), generator=gen, dtype=torch.int64
    ).to(torch.int32)
    return logits, bitmask


@pytest.mark.parametrize("vocab", (31, 64, 100))
def test_each_bit_decides_its_token(vocab):
    logits, bitmask = make(3, 3, vocab, vocab)
    out = logits.clone()
    reference.apply_token_bitmask(out, bitmask)
    for row in range(3):
        for token in range(vocab):
            word = int(bitmask[row, token // 32])
            if python_allowed(word, token % 32):
                assert out[row, token] == logits[row, token]
            else:
                assert out[row, token] == float("-inf")


def test_indices_map_bitmask_rows_to_logits_rows():
    logits, bitmask = make(5, 2, 70, 1)
    indices = torch.tensor([3, 1])
    out = logits.clone()
    reference.apply_token_bitmask(out, bitmask, indices)
    for mask_row, logits_row in enumerate(indices.tolist()):
        for token in range(70):
            allowed = python_allowed(int(bitmask[mask_row, token // 32]), token % 32)
            expected = logits[logits_row, token] if allowed else float("-inf")
            assert out[logits_row, token] == expected
    for row in (0, 2, 4):
        assert torch.equal(out[row], logits[row])


def test_unpack_bitmask_sign_bit():
    bitmask = torch.tensor([[-(2**31)]], dtype=torch.int32)  # only bit 31 set
    bits = reference.unpack_bitmask(bitmask, 32)
    assert bits[0].nonzero().flatten().tolist() == [31]
