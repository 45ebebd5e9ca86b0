"""The platform's weight-only quantized linear kernels (``octavo_quantized_linear_packer``)
against ``octavo.ops.reference.quantized_linear`` (dequantize, then multiply), per row format.
A type the platform has no kernel for is skipped: its weights are dequantized at load."""

from __future__ import annotations

import pytest
import torch

from octavo.ops import reference
from octavo.testing.conformance import tolerances
from octavo.testing.conformance.quantized_cases import (
    QUANT_TYPES,
    RELATIVE_BUDGET,
    SHAPES,
    random_rows,
)

pytest.importorskip("gguf")


@pytest.fixture(params=QUANT_TYPES)
def quant_type(request, octavo_platform):
    if octavo_platform.quantized_linear_packer(request.param) is None:
        pytest.skip(f"platform {octavo_platform.name!r} has no {request.param} kernel")
    return request.param


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_quantized_linear(octavo_platform, octavo_device, quant_type, dtype):
    tolerances.require_dtype(octavo_platform, dtype)
    pack = octavo_platform.quantized_linear_packer(quant_type)
    for index, (m, k, n) in enumerate(SHAPES):
        raw = random_rows(quant_type, n, k, seed=index)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(index)).to(dtype)
        expected = reference.quantized_linear(x, raw, quant_type, k).float()
        out = pack(raw.to(octavo_device), k)(x.to(octavo_device))
        assert out.dtype == dtype and tuple(out.shape) == (m, n), (out.dtype, out.shape)
        error = (out.float().cpu() - expected).norm() / expected.norm()
        assert error <= RELATIVE_BUDGET, f"{quant_type} {dtype} {(m, k, n)}: relative {error:.3g}"


def test_leading_dimensions_are_kept(octavo_platform, octavo_device, quant_type):
    pack = octavo_platform.quantized_linear_packer(quant_type)
    raw = random_rows(quant_type, 40, 256, seed=9)
    x = torch.randn(2, 3, 256, generator=torch.Generator().manual_seed(9))
    out = pack(raw.to(octavo_device), 256)(x.to(octavo_device)).cpu()
    assert out.shape == (2, 3, 40)
    flat = pack(raw.to(octavo_device), 256)(x.reshape(6, 256).to(octavo_device)).cpu()
    torch.testing.assert_close(out.reshape(6, 40), flat, rtol=0, atol=0)
