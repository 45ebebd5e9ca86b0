"""The platform's batched LoRA products (``Platform.lora_kernels``) against the reference:
every token reads its own slot's adapter, tokens without one are left alone. Optional for a
platform: without its kernels the reference serves."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from octavo.lora.mapping import build_lora_mapping
from octavo.ops import reference
from octavo.testing.conformance import tolerances

# (num_tokens, in K, rank R, out N, slots S): no tokens, one token, widths no vector width
# divides, rank 1, a prefill-sized step over a small model's widths.
SHAPES = ((0, 64, 8, 64, 2), (1, 64, 8, 64, 2), (7, 100, 16, 36, 3), (5, 96, 1, 40, 2))
LARGE = ((67, 576, 16, 1536, 4),)
# How the step's tokens map to slots: mixed with base-model rows, every row the base model,
# one adapter for all, and requests' tokens in runs (a prefill chunk per adapter).
PATTERNS = ("mixed", "base_only", "one_adapter", "runs")


def token_slots(pattern: str, num_tokens: int, num_slots: int, rng) -> np.ndarray:
    if pattern == "mixed":
        return rng.integers(-1, num_slots, num_tokens)
    if pattern == "base_only":
        return np.full(num_tokens, -1)
    if pattern == "one_adapter":
        return np.full(num_tokens, num_slots - 1)
    runs = np.repeat(rng.integers(-1, num_slots, 4), -(-num_tokens // 4))
    return runs[:num_tokens]


def cases(quick: bool):
    shapes = SHAPES if quick else SHAPES + LARGE
    return [(shape, pattern) for shape in shapes for pattern in PATTERNS]


@pytest.fixture(params=cases(quick=False), ids=lambda c: "t{}k{}r{}n{}s{}-{}".format(*c[0], c[1]))
def case(request, octavo_conformance_quick):
    if octavo_conformance_quick and request.param not in cases(quick=True):
        pytest.skip("--octavo-conformance-quick")
    return request.param


def make(case, dtype, device):
    (num_tokens, k, rank, n, num_slots), pattern = case
    rng = np.random.default_rng(num_tokens * 7 + k)
    generator = torch.Generator().manual_seed(k + n)
    x = torch.randn(num_tokens, k, generator=generator).to(dtype)
    a_stacked = (torch.randn(num_slots, rank, k, generator=generator) / k**0.5).to(dtype)
    b_stacked = (torch.randn(num_slots, n, rank, generator=generator) / rank**0.5).to(dtype)
    slots = token_slots(pattern, num_tokens, num_slots, rng)
    mapping_host = build_lora_mapping(slots, torch.device("cpu"))
    mapping = build_lora_mapping(slots, device)
    return x, a_stacked, b_stacked, slots, mapping_host, mapping


@pytest.mark.parametrize("dtype", tolerances.ALL_DTYPES, ids=str)
def test_lora_shrink(octavo_platform, octavo_device, dtype, case):
    """``x @ A[slot].T`` per token in float32, zeros for base-model rows; inputs unchanged."""
    tolerances.require_dtype(octavo_platform, dtype)
    x, a_stacked, _, slots, mapping_host, mapping = make(case, dtype, octavo_device)
    expected = reference.lora_shrink(x, a_stacked, mapping_host)
    x_dev, a_dev = x.clone().to(octavo_device), a_stacked.clone().to(octavo_device)
    out = octavo_platform.lora_kernels(dtype).shrink(x_dev, a_dev, mapping)
    assert out.dtype == torch.float32 and out.shape == (x.shape[0], a_stacked.shape[1])
    tolerances.assert_close(out, expected, tolerances.LORA_SHRINK[dtype], f"shrink {case}")
    assert torch.equal(out.cpu()[slots < 0], torch.zeros_like(out.cpu()[slots < 0]))
    assert torch.equal(x_dev.cpu(), x) and torch.equal(a_dev.cpu(), a_stacked)


@pytest.mark.parametrize("dtype", tolerances.ALL_DTYPES, ids=str)
def test_lora_expand(octavo_platform, octavo_device, dtype, case):
    """``y[:, offset:offset+N] += buffer @ B[slot].T`` per token with an adapter, from a
    column slice of a wider buffer into a wider ``y``; every other element of ``y`` stays
    bit-identical."""
    tolerances.require_dtype(octavo_platform, dtype)
    x, a_stacked, b_stacked, slots, mapping_host, mapping = make(case, dtype, octavo_device)
    num_tokens, rank, n = x.shape[0], a_stacked.shape[1], b_stacked.shape[1]
    generator = torch.Generator().manual_seed(rank)
    wide = torch.randn(num_tokens, 3 * rank, generator=generator)
    buffer = wide[:, rank : 2 * rank]  # the middle part of a fused (q, k, v) shrink
    offset = 5
    y = torch.randn(num_tokens, offset + n + 3, generator=generator).to(dtype)
    expected = y.clone()
    reference.lora_expand(expected, buffer, b_stacked, mapping_host, offset)
    y_dev = y.clone().to(octavo_device)  # a copy even where the device is the host
    wide_dev, b_dev = wide.clone().to(octavo_device), b_stacked.clone().to(octavo_device)
    octavo_platform.lora_kernels(dtype).expand(
        y_dev, wide_dev[:, rank : 2 * rank], b_dev, mapping, offset
    )
    out = y_dev.cpu()
    tolerances.assert_close(out, expected, tolerances.LORA_EXPAND[dtype], f"expand {case}")
    untouched = torch.ones_like(out, dtype=torch.bool)
    untouched[torch.from_numpy(slots >= 0), offset : offset + n] = False
    assert torch.equal(out[untouched], y[untouched]), "expand wrote outside its rows' columns"
    assert torch.equal(wide_dev.cpu(), wide) and torch.equal(b_dev.cpu(), b_stacked)


def test_the_reference_is_a_per_token_product():
    """The reference's grouped products equal the per-token definition (the oracle's oracle)."""
    x, a_stacked, b_stacked, slots, mapping, _ = make(
        ((9, 24, 4, 10, 3), "mixed"), torch.float32, "cpu"
    )
    shrunk = reference.lora_shrink(x, a_stacked, mapping)
    y = torch.zeros(9, 10)
    reference.lora_expand(y, shrunk, b_stacked, mapping, 0)
    for t, slot in enumerate(slots):
        want = torch.zeros(10) if slot < 0 else b_stacked[slot] @ (a_stacked[slot] @ x[t])
        torch.testing.assert_close(y[t], want, atol=1e-5, rtol=1e-5)
