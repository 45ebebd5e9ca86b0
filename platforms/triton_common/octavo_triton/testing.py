"""Test support: random flat batches for checking kernels against ``octavo.ops.reference``.

Used by the cuda and rocm test folders (and usable by a vendor checking a Triton kernel pack).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from octavo.platform.types import AttentionMetadata


@dataclasses.dataclass
class PagedBatch:
    """One step's inputs to paged attention, with a KV cache already holding every context."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    kv_cache: torch.Tensor
    metadata: AttentionMetadata


def random_paged_batch(
    query_lens: Sequence[int],
    context_lens: Sequence[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    num_pad_tokens: int = 0,
    seed: int = 0,
) -> PagedBatch:
    """A ragged batch: request ``r`` has ``context_lens[r]`` cached tokens and ``query_lens[r]``
    new ones. Physical blocks are shuffled so that a wrong block-table walk reads wrong keys;
    ``num_pad_tokens`` extra rows at the end have slot -1."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [q + c for q, c in zip(query_lens, context_lens)]
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    max_blocks = max(blocks_per_req, default=1) or 1
    num_blocks = sum(blocks_per_req) + 3
    physical = torch.randperm(num_blocks, generator=gen)
    block_table = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    used = 0
    for r, n in enumerate(blocks_per_req):
        block_table[r, :n] = physical[used : used + n].int()
        used += n
    positions = [torch.arange(c, c + q) for q, c in zip(query_lens, context_lens)]
    slots = [
        block_table[r, pos // block_size].long() * block_size + pos % block_size
        for r, pos in enumerate(positions)
    ]
    slot_mapping = torch.cat(slots + [torch.full((num_pad_tokens,), -1, dtype=torch.long)])
    num_tokens = int(slot_mapping.shape[0])
    query_start_loc = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.tensor(list(query_lens), dtype=torch.int32).cumsum(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    metadata = AttentionMetadata(
        query_start_loc=query_start_loc,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=block_table,
        slot_mapping=slot_mapping,
        max_query_len=max(query_lens, default=0),
        max_seq_len=max(seq_lens, default=0),
        num_actual_tokens=int(query_start_loc[-1]),
    )
    return PagedBatch(
        query=rand(num_tokens, num_heads, head_dim),
        key=rand(num_tokens, num_kv_heads, head_dim),
        value=rand(num_tokens, num_kv_heads, head_dim),
        kv_cache=rand(2, num_blocks, block_size, num_kv_heads, head_dim),
        metadata=metadata,
    )


def to_device(batch: PagedBatch, device) -> PagedBatch:
    """The same batch with every tensor on ``device``."""
    md = batch.metadata
    metadata = AttentionMetadata(
        query_start_loc=md.query_start_loc.to(device),
        seq_lens=md.seq_lens.to(device),
        block_table=md.block_table.to(device),
        slot_mapping=md.slot_mapping.to(device),
        max_query_len=md.max_query_len,
        max_seq_len=md.max_seq_len,
        num_actual_tokens=md.num_actual_tokens,
    )
    return PagedBatch(
        batch.query.to(device),
        batch.key.to(device),
        batch.value.to(device),
        batch.kv_cache.to(device),
        metadata,
    )


def assert_close(
    actual: torch.Tensor, expected: torch.Tensor, ulps: int = 1, fp32_tol: float = 1e-5
):
    """16-bit results within ``ulps`` units in the last place of the expected value; float32
    within ``fp32_tol`` (absolute and relative), since only summation order differs there."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    actual, expected = actual.cpu(), expected.cpu()
    if expected.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, atol=fp32_tol, rtol=fp32_tol)
        return
    magnitude = expected.abs()
    ulp = (
        torch.nextafter(magnitude, torch.full_like(magnitude, float("inf"))).float()
        - magnitude.float()
    )
    error = (actual.float() - expected.float()).abs()
    worst = (error / ulp).max().item()
    assert worst <= ulps, f"max error {worst:.2f} ulps > {ulps} (max abs {error.max().item():.3g})"
