"""Rotary embedding on the host CPU: the compiled kernel (csrc/rotary.cpp) rotates query and key
in place, one call per layer instead of the reference's ~16 torch ops; else None, and the model
composes the reference."""

from __future__ import annotations

from typing import Optional

from octavo.platform import RotaryFn
from octavo_cpu.kernels import load_kernels


def make_rotary_embedding() -> Optional[RotaryFn]:
    """``fn((cos, sin), query, key, head_dim) -> (query, key)``, or None without the library."""
    ops = load_kernels().ops
    if ops is None or not hasattr(ops, "rotary_embedding"):  # none, or a library built before it
        return None

    def rotary_embedding(cos_sin, query, key, head_dim: int):
        cos, sin = cos_sin
        ops.rotary_embedding(query, key, cos, sin, head_dim)
        tokens = query.shape[0]
        return (
            query.view(tokens, query.shape[1] // head_dim, head_dim),
            key.view(tokens, key.shape[1] // head_dim, head_dim),
        )

    return rotary_embedding
