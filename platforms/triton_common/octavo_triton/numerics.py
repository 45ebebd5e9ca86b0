"""Rounding helpers for kernels that run in the Triton interpreter too.

The interpreter converts float32 to bfloat16 by truncation, where GPUs and torch round to
nearest even; kernels that must round to bfloat16 under the interpreter call :func:`narrow` with
``EMULATE`` set, which rounds with integer operations and leaves an exactly representable
float32 (a later store then converts it without loss).
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
def narrow(x, dtype: tl.constexpr, EMULATE: tl.constexpr):
    """``x`` rounded to ``dtype``; under ``EMULATE`` bfloat16 is rounded by hand (float32 out)."""
    if EMULATE and dtype == tl.bfloat16:
        return round_to_bf16(x.to(tl.float32))
    else:
        return x.to(dtype)
