"""The platform's ``rms_norm(hidden_size, eps, dtype)`` against the reference, plain and with the
fused residual add."""

from __future__ import annotations

import pytest
import torch

from octavo.ops import reference
from octavo.testing.conformance import tolerances

# (num_tokens, hidden_size, eps): empty, one token, a ragged count with a hidden size that is
# not a power of two, and the ~100M model's width.
SHAPES = ((0, 64, 1e-5), (1, 64, 1e-6), (13, 200, 1e-5), (5, 768, 1e-6))


def make_inputs(num_tokens, hidden_size, dtype, seed, scale=1.0):
    """Host tensors ``x``, ``residual`` and a non-trivial ``weight`` in ``dtype``."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden_size, generator=generator) * scale
    residual = torch.randn(num_tokens, hidden_size, generator=generator) * scale
    weight = 1.0 + 0.5 * torch.randn(hidden_size, generator=generator)
    return [t.to(dtype) for t in (x, residual, weight)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "t{}h{}".format(*s[:2]))
@pytest.mark.parametrize("dtype", tolerances.ALL_DTYPES, ids=str)
def test_rms_norm(octavo_platform, octavo_device, dtype, shape):
    """``rms_norm(x) * weight``; ``x`` is left as it was."""
    tolerances.require_dtype(octavo_platform, dtype)
    num_tokens, hidden_size, eps = shape
    x, _, weight = make_inputs(num_tokens, hidden_size, dtype, seed=hidden_size)
    fn = octavo_platform.rms_norm(hidden_size, eps, dtype)
    x_dev = x.to(octavo_device, copy=True)
    out = fn(x_dev, weight.to(octavo_device))
    assert out.dtype == dtype and out.shape == x.shape
    tolerances.assert_close(
        out,
        reference.rms_norm(x, weight, eps),
        tolerances.RMS_NORM[dtype],
        f"rms_norm {dtype} {shape}",
    )
    assert torch.equal(x_dev.cpu(), x), "rms_norm without residual modified its input"


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "t{}h{}".format(*s[:2]))
@pytest.mark.parametrize("dtype", tolerances.ALL_DTYPES, ids=str)
def test_fused_residual_add(octavo_platform, octavo_device, dtype, shape):
    """With ``residual``: ``(rms_norm(x + residual) * weight, x + residual)``.

    The kernel may reuse ``x`` and ``residual`` as its outputs (in-place fused kernels do);
    callers use only the returned pair.
    """
    tolerances.require_dtype(octavo_platform, dtype)
    num_tokens, hidden_size, eps = shape
    x, residual, weight = make_inputs(num_tokens, hidden_size, dtype, seed=1)
    expected, expected_residual = reference.rms_norm(x, weight, eps, residual)
    fn = octavo_platform.rms_norm(hidden_size, eps, dtype)
    out, new_residual = fn(*(t.to(octavo_device) for t in (x, weight, residual)))
    tol = tolerances.RMS_NORM[dtype]
    tolerances.assert_close(out, expected, tol, f"fused rms_norm {dtype} {shape}")
    tolerances.assert_close(new_residual, expected_residual, tol, f"fused residual {dtype} {shape}")


@pytest.mark.parametrize("dtype", tolerances.ALL_DTYPES, ids=str)
def test_eps_matters_for_small_inputs(octavo_platform, octavo_device, dtype):
    """Inputs near 1e-3 make ``eps`` dominate the mean square: it must be the one asked for."""
    tolerances.require_dtype(octavo_platform, dtype)
    x, residual, weight = make_inputs(6, 64, dtype, seed=2, scale=1e-3)
    fn = octavo_platform.rms_norm(64, 1e-5, dtype)
    out = fn(x.to(octavo_device), weight.to(octavo_device))
    tolerances.assert_close(
        out,
        reference.rms_norm(x, weight, 1e-5),
        tolerances.RMS_NORM[dtype],
        f"small-input rms_norm {dtype}",
    )


@pytest.mark.parametrize("with_residual", (False, True), ids=("plain", "fused-add"))
def test_leading_dimensions_are_kept(octavo_platform, octavo_device, with_residual):
    """``x`` of shape ``[..., hidden_size]`` normalises over the last dimension and keeps the
    others (a hidden size of 48: not a power of two, smaller than one 64-wide tile)."""
    x, residual, weight = make_inputs(6, 48, torch.float32, seed=3)
    x, residual = x.view(2, 3, 48), residual.view(2, 3, 48)
    fn = octavo_platform.rms_norm(48, 1e-6, torch.float32)
    args = (x, weight, residual) if with_residual else (x, weight)
    out = fn(*(t.to(octavo_device) for t in args))
    expected = reference.rms_norm(x, weight, 1e-6, residual if with_residual else None)
    tol = tolerances.RMS_NORM[torch.float32]
    if with_residual:
        tolerances.assert_close(out[1], expected[1], tol, "fused residual [2, 3, 48]")
        out, expected = out[0], expected[0]
    assert out.shape == (2, 3, 48), f"rms_norm returned shape {tuple(out.shape)}"
    tolerances.assert_close(out, expected, tol, "rms_norm [2, 3, 48]")
