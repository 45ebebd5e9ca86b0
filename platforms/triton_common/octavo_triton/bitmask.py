"""Token-bitmask apply for structured output: disallowed logits become -inf, in place.

Bit ``i`` of int32 word ``j`` of a bitmask row allows token ``32 * j + i`` (xgrammar's packing,
``octavo.ops.reference.apply_token_bitmask``). Tokens beyond the bitmask's ``32 * words`` are
left unchanged.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from octavo_triton.runtime import interpreting
from octavo_triton.tuning import RowTuning


@triton.jit
def apply_bitmask_kernel(
    logits_ptr,
    bitmask_ptr,
    indices_ptr,
    stride_logits,
    stride_bitmask,
    vocab_size,
    num_words,
    HAS_INDICES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Grid ``(bitmask rows, cdiv(vocab, BLOCK))``: one vocabulary chunk of one row."""
    mask_row = tl.program_id(0)
    tokens = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    if HAS_INDICES:
        logits_row = tl.load(indices_ptr + mask_row).to(tl.int64)
    else:
        logits_row = mask_row.to(tl.int64)
    words = tokens // 32
    in_vocab = (tokens < vocab_size) & (words < num_words)
    word = tl.load(bitmask_ptr + mask_row * stride_bitmask + words, mask=in_vocab, other=-1)
    allowed = ((word >> (tokens % 32)) & 1) != 0
    tl.store(
        logits_ptr + logits_row * stride_logits + tokens, float("-inf"), mask=in_vocab & ~allowed
    )


def make_apply_token_bitmask(tuning: RowTuning = RowTuning()):
    """Return ``fn(logits, bitmask, indices=None)`` (the hook's contract)."""
    block = tuning.bitmask_block
    launch = {} if interpreting() else {"num_warps": max(1, block // (tuning.warp_size * 8))}

    def apply_token_bitmask(
        logits: torch.Tensor, bitmask: torch.Tensor, indices: Optional[torch.Tensor] = None
    ) -> None:
        """In place: logits of tokens whose bit is 0 become -inf; ``indices[i]`` is the logits
        row that bitmask row ``i`` applies to (default: row ``i``)."""
        assert logits.stride(-1) == 1, "logits rows must be contiguous"
        rows, num_words = bitmask.shape
        vocab = logits.shape[-1]
        if rows == 0 or vocab == 0:
            return
        bitmask = bitmask.to(device=logits.device, dtype=torch.int32).contiguous()
        idx = bitmask if indices is None else indices.to(device=logits.device, dtype=torch.int64)
        apply_bitmask_kernel[(rows, triton.cdiv(vocab, block))](
            logits,
            bitmask,
            idx,
            logits.stride(0),
            bitmask.stride(0),
            vocab,
            num_words,
            HAS_INDICES=indices is not None,
            BLOCK=block,
            **launch,
        )

    return apply_token_bitmask
