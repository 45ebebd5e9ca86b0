"""The cpu platform's linear layers: oneDNN GEMMs over weights reordered once, at load.

``torch.ops.mkldnn._reorder_linear_weight`` lays a weight out in oneDNN's blocked format once;
``_linear_pointwise`` then multiplies without re-packing it every call, as ``F.linear`` does
(benchmarks/cpu_gemm.py measures both on this host). For bfloat16 the results are the same bits
as ``F.linear``'s (torch's bfloat16 matmul is oneDNN's); for float32 they differ from MKL's by
summation order only. ``OCTAVO_CPU_GEMM=torch`` keeps ``F.linear``.
"""

from __future__ import annotations

import os
from typing import Callable, Optional

import torch

from octavo.platform import LinearPacker

GEMM_ENV = "OCTAVO_CPU_GEMM"
BATCH_HINT = 64  # the rows oneDNN's reorder is tuned for (a hint: any row count works)


def linear_packer(dtype: torch.dtype) -> Optional[LinearPacker]:
    """The packer for ``dtype``'s linear layers, or None (``F.linear``)."""
    choice = os.environ.get(GEMM_ENV, "onednn").strip().lower()
    if choice not in ("onednn", "torch"):
        raise ValueError(f"{GEMM_ENV}={choice!r}: use onednn or torch")
    if choice == "torch" or not torch.backends.mkldnn.is_available():
        return None
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return None  # no native bfloat16: the layers are widened to float32 instead
    if dtype not in (torch.float32, torch.bfloat16):
        return None
    return pack_onednn


def pack_onednn(weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """``fn(x) -> x @ weight.T`` over ``weight`` reordered once for oneDNN."""
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), BATCH_HINT)
    linear = torch.ops.mkldnn._linear_pointwise

    def product(x: torch.Tensor) -> torch.Tensor:
        return linear(x, packed, None, "none", [], "")

    return product
