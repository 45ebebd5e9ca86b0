"""Paged attention scenarios: a sequence of calls on one KV cache, run on a platform and on the
reference side by side.

A scenario is a tuple of calls; a call is a tuple of ``(request, num_computed_tokens,
num_new_tokens)`` chunks in batch order. Each request gets its physical blocks from a shuffled
pool (so they are never contiguous) and stale block ids after its last block, as a persistent
block table has. The platform's cache starts as random finite values, so a kernel that reads a
slot it has not written shows up as a wrong output. Each call is compared on its own, and the
context a call reads was written by earlier calls of the same backend, so any KV layout works.
With ``fused_qkv`` the platform gets query, key and value as column slices of one tensor, as a
model's fused QKV projection produces them (strided views, not contiguous tensors).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch

from octavo.ops import reference
from octavo.platform.types import AttentionMetadata, AttentionSpec

Chunk = tuple[int, int, int]
"""``(request, num_computed_tokens, num_new_tokens)``."""


@dataclasses.dataclass(frozen=True)
class CallResult:
    """One call's outputs for the real (non-padding) tokens."""

    description: str
    actual: torch.Tensor
    expected: torch.Tensor


def allocate_block_tables(
    max_seq_lens: Sequence[int], block_size: int, generator: torch.Generator
) -> tuple[torch.Tensor, int]:
    """Disjoint shuffled blocks per request plus stale ids after them; returns
    ``(block_tables [num_requests, max_blocks] int32, num_blocks)``."""
    needed = [-(-n // block_size) for n in max_seq_lens]
    max_blocks = max(needed, default=0) + 2
    num_blocks = sum(needed) + 3
    pool = torch.randperm(num_blocks, generator=generator)
    tables = torch.randint(0, num_blocks, (len(needed), max_blocks), generator=generator)
    start = 0
    for r, n in enumerate(needed):
        tables[r, :n] = pool[start : start + n]
        start += n
    return tables.to(torch.int32), num_blocks


def build_metadata(
    chunks: Sequence[Chunk], block_tables: torch.Tensor, block_size: int, num_padding: int = 0
) -> AttentionMetadata:
    """Host metadata for one call; ``num_padding`` extra tokens at the end get slot -1."""
    query_lens = [n for _, _, n in chunks]
    seq_lens = [c + n for _, c, n in chunks]
    slots = []
    for request, computed, new in chunks:
        positions = torch.arange(computed, computed + new)
        blocks = block_tables[request].long()[positions // block_size]
        slots.append(blocks * block_size + positions % block_size)
    slots.append(torch.full((num_padding,), -1, dtype=torch.int64))
    query_start_loc = torch.tensor([0] + query_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    rows = [r for r, _, _ in chunks]
    return AttentionMetadata(
        query_start_loc=query_start_loc,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=block_tables[rows].contiguous(),
        slot_mapping=torch.cat(slots),
        max_query_len=max(query_lens, default=0),
        max_seq_len=max(seq_lens, default=0),
        num_actual_tokens=sum(query_lens),
    )


def metadata_to(metadata: AttentionMetadata, device: torch.device) -> AttentionMetadata:
    """The same metadata with its tensors on ``device``."""
    return dataclasses.replace(
        metadata,
        query_start_loc=metadata.query_start_loc.to(device),
        seq_lens=metadata.seq_lens.to(device),
        block_table=metadata.block_table.to(device),
        slot_mapping=metadata.slot_mapping.to(device),
    )


def fused_views(q, k, v, device: torch.device) -> tuple[torch.Tensor, ...]:
    """``q``, ``k``, ``v`` on ``device`` as column slices of one ``[T, (H + 2 KV) * D]`` tensor."""
    fused = torch.cat([t.flatten(1) for t in (q, k, v)], dim=1).to(device)
    parts = fused.split([q[0].numel(), k[0].numel(), v[0].numel()], dim=1)
    return tuple(part.view(t.shape) for part, t in zip(parts, (q, k, v)))


def run_scenario(
    platform,
    spec: AttentionSpec,
    scenario: Sequence[Sequence[Chunk]],
    device: torch.device,
    seed: int = 0,
    padding: Optional[dict[int, int]] = None,
    fused_qkv: bool = False,
) -> list[CallResult]:
    """Run every call of ``scenario`` through the platform's backend and the reference."""
    generator = torch.Generator().manual_seed(seed)
    num_requests = 1 + max((c[0] for call in scenario for c in call), default=-1)
    max_seq_lens = [0] * num_requests
    for call in scenario:
        for request, computed, new in call:
            max_seq_lens[request] = max(max_seq_lens[request], computed + new)
    block_tables, num_blocks = allocate_block_tables(max_seq_lens, spec.block_size, generator)

    backend = platform.attention_backend(spec)
    shape = backend.kv_cache_shape(num_blocks)
    kv_cache = torch.randn(shape, generator=generator).to(spec.dtype).to(device)
    ref_shape = (2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
    ref_cache = torch.randn(ref_shape, generator=generator).to(spec.dtype)

    results = []
    for index, call in enumerate(scenario):
        num_padding = (padding or {}).get(index, 0)
        metadata = build_metadata(call, block_tables, spec.block_size, num_padding)
        num_tokens = metadata.slot_mapping.shape[0]
        q = torch.randn(num_tokens, spec.num_heads, spec.head_dim, generator=generator)
        k = torch.randn(num_tokens, spec.num_kv_heads, spec.head_dim, generator=generator)
        v = torch.randn(num_tokens, spec.num_kv_heads, spec.head_dim, generator=generator)
        q, k, v = (t.to(spec.dtype) for t in (q, k, v))
        expected = reference.paged_attention(
            q, k, v, ref_cache, metadata, spec.scale, spec.sliding_window
        )
        inputs = fused_views(q, k, v, device) if fused_qkv else (t.to(device) for t in (q, k, v))
        actual = backend.forward(*inputs, kv_cache, metadata_to(metadata, device))
        assert actual.shape == q.shape, f"call {index}: output shape {tuple(actual.shape)}"
        assert actual.dtype == spec.dtype, f"call {index}: output dtype {actual.dtype}"
        n = metadata.num_actual_tokens
        results.append(CallResult(f"call {index} {list(call)}", actual[:n].cpu(), expected[:n]))
    return results
