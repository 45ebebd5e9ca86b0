"""The platform's ``scaled_mm()`` (FP8, for ``--quantization fp8``) against the reference:
per-tensor, per-token and per-channel scales, with and without bias, on the operands the FP8
linear layer passes. Platforms without FP8 (``capabilities.supports_fp8`` False) skip."""

from __future__ import annotations

import pytest
import torch

from octavo.ops import reference
from octavo.testing.conformance import tolerances
from octavo.testing.conformance.scaled_mm_cases import SCALES, SHAPES, make_operands


@pytest.fixture(scope="module")
def scaled_mm(octavo_platform):
    """The platform's kernel; one that claims FP8 must provide it."""
    if not octavo_platform.capabilities.supports_fp8:
        pytest.skip(f"platform {octavo_platform.name!r} does not offer FP8 (supports_fp8=False)")
    return octavo_platform.scaled_mm()


def run(scaled_mm, device, operands, out_dtype):
    """The kernel on the operands moved to ``device``; checks the result's shape and dtype."""
    on = operands.to(device)
    out = scaled_mm(on.a, on.b, on.scale_a, on.scale_b, out_dtype, on.bias)
    expected_shape = (operands.a.shape[0], operands.b.shape[1])
    assert out.dtype == out_dtype, f"scaled_mm returned {out.dtype}, asked for {out_dtype}"
    assert tuple(out.shape) == expected_shape, f"scaled_mm returned shape {tuple(out.shape)}"
    return out


@pytest.mark.parametrize("with_bias", (False, True), ids=("no-bias", "bias"))
@pytest.mark.parametrize("scales", SCALES)
@pytest.mark.parametrize("out_dtype", tolerances.ALL_DTYPES, ids=str)
def test_scaled_mm(octavo_platform, octavo_device, scaled_mm, out_dtype, scales, with_bias):
    """``(a @ b) * scale_a * scale_b (+ bias)`` in ``out_dtype``, ``b`` a transposed weight."""
    tolerances.require_dtype(octavo_platform, out_dtype)
    for index, shape in enumerate(SHAPES):
        operands = make_operands(shape, scales, out_dtype, with_bias, seed=index)
        expected = reference.scaled_mm(
            operands.a, operands.b, operands.scale_a, operands.scale_b, out_dtype, operands.bias
        )
        actual = run(scaled_mm, octavo_device, operands, out_dtype)
        tolerances.assert_close(
            actual,
            expected,
            tolerances.SCALED_MM[out_dtype],
            f"scaled_mm {out_dtype} {scales} {'bias' if with_bias else 'no bias'} {shape}",
        )


def test_contiguous_b(octavo_platform, octavo_device, scaled_mm):
    """A row-major ``[K, N]`` ``b`` works as well as a transposed weight."""
    operands = make_operands((9, 48, 20), "token x channel", torch.float32, True, False, seed=5)
    assert operands.b.is_contiguous()
    expected = reference.scaled_mm(
        operands.a, operands.b, operands.scale_a, operands.scale_b, torch.float32, operands.bias
    )
    actual = run(scaled_mm, octavo_device, operands, torch.float32)
    tolerances.assert_close(
        actual, expected, tolerances.SCALED_MM[torch.float32], "scaled_mm, contiguous b"
    )


def test_empty_batch(octavo_platform, octavo_device, scaled_mm):
    """No tokens in, an empty ``[0, N]`` result out."""
    operands = make_operands((1, 16, 8), "token x channel", torch.float32, False)
    empty = type(operands)(operands.a[:0], operands.b, operands.scale_a[:0], operands.scale_b, None)
    assert run(scaled_mm, octavo_device, empty, torch.float32).shape == (0, 8)
