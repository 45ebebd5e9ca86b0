"""How close a platform's kernel must come to ``octavo.ops.reference``, per dtype.

The reference computes in float32 and rounds once to the output dtype. A platform kernel may
round more often (scores, softmax weights or the RMSNorm product kept in the input dtype), so
the budgets are a few units in the last place of each dtype:

- float32: ``~1e-5``: only summation order differs.
- float16 (10-bit mantissa, eps 9.8e-4): attention ``5e-3``, a handful of ulps, covering the
  softmax weights rounded to fp16 before the product with V; RMSNorm ``2e-3``, the double
  rounding of HuggingFace's ``weight * h.to(dtype)``.
- bfloat16 (7-bit mantissa, eps 7.8e-3): attention ``3e-2`` and RMSNorm ``1.6e-2`` likewise.
- FP8 scaled matmul: products of FP8 values are exact in float32 and the sum is rounded once to
  the output dtype, so only summation order differs: the RMSNorm budgets, about one ulp.

A real bug (a wrong mask, a missing context block, a wrong GQA mapping, a wrong scale) moves
outputs by O(0.1..1), far beyond every budget; fp32 cases catch the subtle ones.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

ALL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""Dtypes the suite knows; a case runs for those in the platform's ``capabilities.dtypes``."""

BLOCK_SIZES = (1, 16, 32, 128)
"""Block sizes the suite checks, intersected with the platform's ``capabilities.block_sizes``."""


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """``|actual - expected| <= atol + rtol * |expected|`` elementwise."""

    atol: float
    rtol: float


ATTENTION = {
    torch.float32: Tolerance(atol=2e-5, rtol=1e-5),
    torch.float16: Tolerance(atol=5e-3, rtol=5e-3),
    torch.bfloat16: Tolerance(atol=3e-2, rtol=3e-2),
}

ROTARY = {  # the reference's arithmetic (products and sum rounded to the dtype): exact
    dtype: Tolerance(atol=0.0, rtol=0.0) for dtype in (torch.float32, torch.float16, torch.bfloat16)
}

SILU_AND_MUL = {
    torch.float32: Tolerance(atol=1e-5, rtol=1e-5),
    torch.float16: Tolerance(atol=1e-3, rtol=2e-3),  # one rounding of silu's result, then one
    torch.bfloat16: Tolerance(atol=1e-2, rtol=1.6e-2),  # of the product
}

RMS_NORM = {
    torch.float32: Tolerance(atol=1e-5, rtol=1e-5),
    torch.float16: Tolerance(atol=1e-4, rtol=2e-3),
    torch.bfloat16: Tolerance(atol=1e-3, rtol=1.6e-2),
}


SCALED_MM = {
    torch.float32: Tolerance(atol=1e-5, rtol=1e-5),
    torch.float16: Tolerance(atol=1e-4, rtol=2e-3),
    torch.bfloat16: Tolerance(atol=1e-3, rtol=1.6e-2),
}

FUSED_MOE = {  # two products per expert and a weighted sum over the chosen experts: a kernel
    # may keep the intermediate activations or the sum in float32 where the reference rounds
    torch.float32: Tolerance(atol=1e-4, rtol=1e-4),
    torch.float16: Tolerance(atol=5e-3, rtol=5e-3),
    torch.bfloat16: Tolerance(atol=3e-2, rtol=3e-2),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: Tolerance, what: str) -> None:
    """Compare on the host in float32, with a message naming the case and the worst element."""
    actual = actual.detach().float().cpu()
    expected = expected.detach().float().cpu()
    assert actual.shape == expected.shape, (
        f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    )
    torch.testing.assert_close(
        actual, expected, atol=tol.atol, rtol=tol.rtol, msg=lambda m: f"{what}: {m}"
    )


def require_dtype(platform, dtype: torch.dtype) -> None:
    """Skip the case when the platform does not offer ``dtype``."""
    if dtype not in platform.capabilities.dtypes:
        pytest.skip(f"platform {platform.name!r} does not offer {dtype}")


def require_block_size(platform, block_size: int) -> None:
    """Skip the case when the platform does not offer ``block_size``."""
    if block_size not in platform.capabilities.block_sizes:
        pytest.skip(f"platform {platform.name!r} does not offer block size {block_size}")


LORA_SHRINK = {  # float32 out; products of the inputs exact in float32: summation order only
    dtype: Tolerance(atol=1e-4, rtol=1e-5)
    for dtype in (torch.float32, torch.float16, torch.bfloat16)
}

LORA_EXPAND = {  # the float32 sum rounded once to y's dtype
    torch.float32: Tolerance(atol=1e-4, rtol=1e-5),
    torch.float16: Tolerance(atol=1e-3, rtol=1e-3),
    torch.bfloat16: Tolerance(atol=1e-2, rtol=8e-3),
}
