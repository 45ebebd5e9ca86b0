"""Token-bitmask application on the host CPU: xgrammar's native CPU kernel when xgrammar is
installed (float32/bfloat16/float16 logits; 3-8x faster than torch bit tests at 64 x 32000),
else vectorised torch bit tests. xgrammar is imported on the first call, not at start-up:
importing it takes seconds and only structured-output requests need it."""

from __future__ import annotations

from typing import Callable, Optional

import torch

NATIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def torch_apply_token_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, indices: Optional[torch.Tensor] = None
) -> None:
    """In place: logits whose bit is 0 become -inf; bitmask row ``i`` masks logits row
    ``indices[i]`` (default ``i``)."""
    vocab = logits.shape[-1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :vocab].bool()
    if indices is None:
        logits[: bitmask.shape[0]].masked_fill_(~allowed, float("-inf"))
    else:
        rows = indices.long()
        logits[rows] = logits[rows].masked_fill_(~allowed, float("-inf"))


def load_xgrammar_kernel() -> Optional[Callable]:
    """xgrammar's CPU kernel, or None when xgrammar is not installed."""
    try:
        from xgrammar.kernels.apply_token_bitmask_inplace_cpu import (
            apply_token_bitmask_inplace_cpu,
        )
    except ImportError:
        return None
    return apply_token_bitmask_inplace_cpu


class TokenBitmaskKernel:
    """``fn(logits [R, V], bitmask [B, ceil(V/32)] int32, indices=None)``, in place."""

    __slots__ = ("_native", "_loaded")

    def __init__(self) -> None:
        self._native: Optional[Callable] = None
        self._loaded = False

    def __call__(self, logits, bitmask, indices=None) -> None:
        if not self._loaded:
            self._native, self._loaded = load_xgrammar_kernel(), True
        native = self._native
        if native is None or logits.dtype not in NATIVE_DTYPES or bitmask.dtype != torch.int32:
            return torch_apply_token_bitmask(logits, bitmask, indices)
        vocab = logits.shape[-1]
        if indices is None:
            native(logits[: bitmask.shape[0]], bitmask, vocab, None)
            return None
        # xgrammar's indices pick the same row of logits and bitmask; ours map bitmask row i
        # to logits row indices[i], so spread the bitmask over all rows (all-ones elsewhere).
        full = torch.full((logits.shape[0], bitmask.shape[1]), -1, dtype=torch.int32)
        rows = indices.long()
        full[rows] = bitmask
        native(logits, full, vocab, rows.tolist())
        return None
