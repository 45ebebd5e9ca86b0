"""SiLU-and-multiply on the host CPU: the compiled kernel (csrc/activation.cpp) when it is built;
else None, and the model composes the reference's two torch ops."""

from __future__ import annotations

from typing import Optional

import torch

from octavo.platform import SiluAndMulFn
from octavo_cpu.kernels import load_kernels


def make_silu_and_mul() -> Optional[SiluAndMulFn]:
    """``fn(gate, up) -> silu(gate) * up`` in one pass, or None without compiled kernels."""
    ops = load_kernels().ops
    if ops is None:
        return None

    def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(gate)
        ops.silu_and_mul(out, gate, up)
        return out

    return silu_and_mul
