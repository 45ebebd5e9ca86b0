"""Token-bitmask application on the host CPU: xgrammar's native CPU kernel when xgrammar is
installed (float32/bfloat16/float16 logits), else vectorised torch bit tests."""

from __future__ import annotations

from typing import Optional

import torch


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


def make_apply_token_bitmask():
    """The fastest available implementation of the bitmask kernel contract."""
    try:
        from xgrammar.kernels.apply_token_bitmask_inplace_cpu import (
            apply_token_bitmask_inplace_cpu,
        )
    except ImportError:
        return torch_apply_token_bitmask
    native_dtypes = (torch.float32, torch.bfloat16, torch.float16)

    def apply_token_bitmask(logits, bitmask, indices=None) -> None:
        """In place: logits whose bit is 0 become -inf (xgrammar's CPU kernel)."""
        if logits.dtype not in native_dtypes or bitmask.dtype != torch.int32:
            return torch_apply_token_bitmask(logits, bitmask, indices)
        vocab = logits.shape[-1]
        if indices is None:
            apply_token_bitmask_inplace_cpu(logits[: bitmask.shape[0]], bitmask, vocab, None)
            return None
        # xgrammar's indices pick the same row of logits and bitmask; ours map bitmask row i
        # to logits row indices[i], so spread the bitmask over all rows (all-ones elsewhere).
        full = torch.full((logits.shape[0], bitmask.shape[1]), -1, dtype=torch.int32)
        rows = indices.long()
        full[rows] = bitmask
        apply_token_bitmask_inplace_cpu(logits, full, vocab, rows.tolist())
        return None

    return apply_token_bitmask
