"""octavo.ops.reference.rms_norm against transformers' LlamaRMSNorm."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from octavo.ops import reference


def hf_norm(hidden_size, eps, dtype, seed=0):
    norm = LlamaRMSNorm(hidden_size, eps=eps)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        norm.weight.copy_(1.0 + 0.3 * torch.randn(hidden_size, generator=generator))
    return norm.to(dtype)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("eps", (1e-5, 1e-6))
def test_matches_llama_rms_norm(dtype, eps):
    norm = hf_norm(96, eps, dtype)
    x = torch.randn(7, 96, generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.no_grad():
        expected = norm(x)
    out = reference.rms_norm(x, norm.weight.detach(), eps)
    assert out.dtype == dtype
    # The same operations in the same order: bit-for-bit.
    assert torch.equal(out, expected)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_residual_form_adds_first_in_the_input_dtype(dtype):
    norm = hf_norm(64, 1e-5, dtype, seed=2)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 64, generator=gen).to(dtype)
    residual = torch.randn(5, 64, generator=gen).to(dtype)
    out, new_residual = reference.rms_norm(x, norm.weight.detach(), 1e-5, residual)
    assert torch.equal(new_residual, x + residual)
    with torch.no_grad():
        assert torch.equal(out, norm(x + residual))


def test_eps_is_inside_the_square_root():
    x = torch.full((1, 4), 1e-3)
    out = reference.rms_norm(x, torch.ones(4), 1e-5)
    expected = 1e-3 / (1e-6 + 1e-5) ** 0.5
    torch.testing.assert_close(out, torch.full((1, 4), expected), rtol=1e-6, atol=0)


def test_empty_batch():
    assert reference.rms_norm(torch.zeros(0, 8), torch.ones(8), 1e-6).shape == (0, 8)
