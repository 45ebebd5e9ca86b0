"""The platform's ``silu_and_mul(gate, up)`` (the Llama MLP's activation) against the reference.
Optional for a platform: without its kernel, ``Platform.silu_and_mul`` is the reference itself."""

from __future__ import annotations

import pytest
import torch

from octavo.ops import reference
from octavo.testing.conformance import tolerances

# (num_tokens, intermediate_size): empty, one token, a width that is not a multiple of any
# vector width, and the ~100M model's width.
SHAPES = ((0, 64), (1, 256), (7, 100), (5, 2048))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "t{}i{}".format(*s))
@pytest.mark.parametrize("dtype", tolerances.ALL_DTYPES, ids=str)
def test_silu_and_mul(octavo_platform, octavo_device, dtype, shape):
    """``silu(gate) * up`` in the inputs' dtype, from gate and up as the MLP makes them (row
    slices of one projection output) and as plain tensors; the inputs are left as they were."""
    tolerances.require_dtype(octavo_platform, dtype)
    num_tokens, size = shape
    generator = torch.Generator().manual_seed(size)
    fused = (torch.randn(num_tokens, 2 * size, generator=generator) * 3).to(dtype)
    gate, up = fused[:, :size], fused[:, size:]
    fn = octavo_platform.silu_and_mul()
    expected = reference.silu_and_mul(gate, up)
    for g, u in ((gate, up), (gate.contiguous(), up.contiguous())):
        g_dev, u_dev = g.to(octavo_device), u.to(octavo_device)
        before = (g_dev.clone(), u_dev.clone())
        out = fn(g_dev, u_dev)
        assert out.dtype == dtype and out.shape == (num_tokens, size)
        tolerances.assert_close(out, expected, tolerances.SILU_AND_MUL[dtype], f"{dtype} {shape}")
        assert torch.equal(g_dev, before[0]) and torch.equal(u_dev, before[1])
