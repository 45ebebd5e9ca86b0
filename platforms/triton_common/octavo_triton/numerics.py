"""Rounding helpers for kernels that run in the Triton interpreter too.

The interpreter converts float32 to bfloat16 by truncation, and to float8 e4m3 without carrying
a rounded-up mantissa into the exponent (126.9 becomes 64), where GPUs and torch round to
nearest even. Kernels call :func:`narrow` with ``EMULATE`` set under the interpreter: it rounds
by hand and leaves an exactly representable float32, which a later store converts without loss.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_to_bf16(x):
    """``x`` (float32) rounded to the nearest bfloat16, ties to even, kept as float32."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def round_to_e4m3(x):
    """``x`` (float32, within e4m3's range) rounded to the nearest float8 e4m3, ties to even,
    kept as float32: 3 mantissa bits for normals, multiples of 2**-9 below 2**-6."""
    bits = x.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
    magic = 24576.0  # 1.5 * 2**14: float32 spacing there is 2**-9, e4m3's subnormal step
    subnormal = (x + magic) - magic
    return tl.where(tl.abs(x) < 0.015625, subnormal, normal)


@triton.jit
def narrow(x, dtype: tl.constexpr, EMULATE: tl.constexpr):
    """``x`` rounded to ``dtype``; under ``EMULATE`` bfloat16 and float8 e4m3 are rounded by
    hand (float32 out)."""
    if EMULATE and dtype == tl.bfloat16:
        return round_to_bf16(x.to(tl.float32))
    elif EMULATE and dtype == tl.float8e4nv:
        return round_to_e4m3(x.to(tl.float32))
    else:
        return x.to(dtype)
