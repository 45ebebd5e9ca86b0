"""Paged attention on the host CPU: the compiled kernel (csrc/paged_attention.cpp) when it is
built, else torch ops (batched decodes, one SDPA call per prefill chunk).

The KV cache is head-major inside a block: ``[2, num_blocks, num_kv_heads, block_size,
head_dim]``, so one KV head's tokens of one block are a contiguous tile. V's tile is
``[block_size, head_dim]``; K's tile holds the same values transposed, ``[head_dim,
block_size]``, so the compiled kernel scores a query against a whole block with vector FMAs
over head_dim (chosen by benchmarks/cpu_kernels.py: a row-major K cost a transposition per
block per step). The torch path reads tiles with one ``index_select`` each and transposes K's
back to token rows for SDPA; new K/V go in with one ``index_copy_`` per tensor.

With the compiled kernel, one call writes the step's K/V and attends every request of the mixed
batch in place, prefill chunks included (benchmarks/cpu_kernels.py: faster than SDPA for every
chunk length measured, fresh 512-token prompts ~2x). On the torch path, decode rows (one new
token) of all requests are served together: their context is gathered into a reused workspace
and attended with one ``scaled_dot_product_attention`` call whose boolean mask hides each row's
padding; the query heads that share a KV head ride along as that call's query length. Prefill
chunks get one SDPA call each: a fresh prompt attends straight to its new K/V with
``is_causal``; a chunk after context reads its blocks with a lower-right causal mask. Every
SDPA call is 4-D: with 3-D inputs torch falls back to its slow math path.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from octavo.platform.types import AttentionBackend, AttentionMetadata
from octavo_cpu.kernels import CpuKernels, load_kernels

WORKSPACE_BYTES = 64 << 20
"""Decode rows are gathered in groups whose K+V stay under this size (bounded memory). Fewer,
larger groups measured faster with two threads on a busy host (each group is a few parallel
regions); 64 MiB holds 64 requests x 512 tokens of the ~100M model's fp32 K+V in one group."""


class CpuAttentionBackend(AttentionBackend):
    """Paged attention for the cpu platform (mixed prefill chunks and decodes in one call)."""

    name = "cpu"
    block_dim = 1

    def __init__(self, spec, kernels: Optional[CpuKernels] = None):
        super().__init__(spec)
        self._workspace = torch.empty(0, dtype=spec.dtype)
        self.kernels = load_kernels() if kernels is None else kernels
        window = spec.sliding_window
        self._window = -1 if window is None else int(window)

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        s = self.spec
        return (2, num_blocks, s.num_kv_heads, s.block_size, s.head_dim)

    def forward(self, query, key, value, kv_cache, metadata: AttentionMetadata):
        """Write the new K/V through ``slot_mapping``, then attend through ``block_table``."""
        num_tokens = metadata.num_actual_tokens
        if num_tokens < 0:
            num_tokens = query.shape[0]
        ops = self.kernels.ops
        if ops is not None and _compiled_path_fits(query, key, value, kv_cache):
            return self._forward_compiled(ops, query, key, value, kv_cache, metadata, num_tokens)
        slot_mapping = metadata.slot_mapping[:num_tokens]
        write_kv(key[:num_tokens], value[:num_tokens], kv_cache, slot_mapping)
        out = torch.empty_like(query)
        out[num_tokens:].zero_()
        if metadata.num_reqs == 0 or num_tokens == 0:
            return out
        query_start_loc = metadata.query_start_loc
        if metadata.max_query_len == 1 and num_tokens == metadata.num_reqs:
            self._decode(query, kv_cache, metadata, None, out)
            return out
        query_lens = query_start_loc[1:] - query_start_loc[:-1]
        is_decode = query_lens == 1
        decode_rows = is_decode.nonzero().flatten()
        if decode_rows.numel():
            self._decode(query, kv_cache, metadata, decode_rows, out)
        starts = query_start_loc.tolist()
        seq_lens = metadata.seq_lens.tolist()
        rows = (~is_decode & (query_lens > 0)).nonzero().flatten().tolist()
        chunks = [(row, starts[row], starts[row + 1], seq_lens[row]) for row in rows]
        self._prefill_chunks(out, query, key, value, kv_cache, metadata, chunks)
        return out

    def _forward_compiled(self, ops, query, key, value, kv_cache, metadata, num_tokens):
        """The compiled kernel writes the K/V and attends every request, in one call."""
        out = torch.empty_like(query)
        if num_tokens < query.shape[0]:  # padding rows (never, in a compiled graph's trace)
            out[num_tokens:].zero_()
        ops.paged_attention(
            out,
            query,
            key,
            value,
            kv_cache,
            metadata.slot_mapping,
            metadata.block_table,
            metadata.query_start_loc,
            metadata.seq_lens,
            self.spec.scale,
            self._window,
            num_tokens,
        )
        return out

    def _prefill_chunks(self, out, query, key, value, kv_cache, metadata, chunks) -> None:
        """SDPA for each ``(row, start, end, seq_len)`` prefill chunk, into ``out[start:end]``."""
        for row, start, end, seq_len in chunks:
            out[start:end] = self._prefill(
                query[start:end],
                key[start:end],
                value[start:end],
                kv_cache,
                metadata.block_table[row],
                seq_len,
            )

    def _gather_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        if self._workspace.numel() < numel or self._workspace.dtype != dtype:
            self._workspace = torch.empty(numel, dtype=dtype)
        return self._workspace[:numel]

    def _decode(self, query, kv_cache, metadata, rows, out) -> None:
        """All one-token rows, longest context first, in workspace-sized groups: each group is
        padded only to its own longest row, so ragged batches waste little."""
        spec = self.spec
        if rows is None:
            tokens = metadata.query_start_loc[:-1].long()
            seq_lens = metadata.seq_lens.long()
            block_table = metadata.block_table
        else:
            tokens = metadata.query_start_loc[rows].long()
            seq_lens = metadata.seq_lens[rows].long()
            block_table = metadata.block_table[rows]
        first_block = torch.zeros_like(seq_lens)
        if spec.sliding_window is not None:
            first_block = (seq_lens - spec.sliding_window).clamp(min=0) // spec.block_size
        needed = (seq_lens + spec.block_size - 1) // spec.block_size - first_block
        order = needed.argsort(descending=True)
        needed_sorted = needed[order].tolist()
        block_bytes = 2 * kv_cache[0, 0].numel() * kv_cache.element_size()  # K and V
        q = query[tokens].view(
            -1, spec.num_kv_heads, spec.num_heads // spec.num_kv_heads, spec.head_dim
        )
        start = 0
        while start < len(needed_sorted):
            num_blocks = needed_sorted[start]
            group = max(1, WORKSPACE_BYTES // (block_bytes * num_blocks))
            group_rows = order[start : start + group]
            o = self._decode_group(
                q[group_rows],
                kv_cache,
                block_table[group_rows],
                seq_lens[group_rows],
                first_block[group_rows],
                num_blocks,
            )
            out[tokens[group_rows]] = o.reshape(-1, spec.num_heads, spec.head_dim)
            start += group

    def _decode_group(self, q, kv_cache, block_table, seq_lens, first_block, num_blocks):
        """Gather a group's context (``num_blocks`` blocks from each row's first) and attend."""
        spec = self.spec
        # Past a row's last block the table holds stale or padding ids: clamp them to valid
        # blocks; what they hold is masked out.
        offsets = (first_block.unsqueeze(1) + torch.arange(num_blocks)).clamp(
            max=block_table.shape[1] - 1
        )
        block_ids = block_table.long().gather(1, offsets).clamp_(min=0)
        index = head_rows(block_ids, spec.num_kv_heads).flatten()
        cache_rows = kv_cache.view(2, -1, spec.block_size * spec.head_dim)
        buffer = self._gather_buffer(2 * index.numel() * cache_rows.shape[2], kv_cache.dtype)
        buffer = buffer.view(2, index.numel(), cache_rows.shape[2])
        torch.index_select(cache_rows[0], 0, index, out=buffer[0])
        torch.index_select(cache_rows[1], 0, index, out=buffer[1])
        num_slots = num_blocks * spec.block_size
        k = k_tiles_as_rows(buffer[0], q.shape[0], spec, num_blocks)
        v = buffer[1].view(q.shape[0], spec.num_kv_heads, num_slots, spec.head_dim)
        positions = first_block.unsqueeze(1) * spec.block_size + torch.arange(num_slots)
        visible = positions < seq_lens.unsqueeze(1)
        if spec.sliding_window is not None:
            visible &= positions >= (seq_lens - spec.sliding_window).unsqueeze(1)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=visible[:, None, None, :], scale=spec.scale
        )

    def _prefill(self, query, key, value, kv_cache, block_ids, seq_len: int) -> torch.Tensor:
        """One request's chunk of new tokens attending causally to its context and itself."""
        spec = self.spec
        query_len = query.shape[0]
        window = spec.sliding_window
        fresh = seq_len == query_len and kv_cache.dtype == key.dtype
        # Strided views, not head-major copies: SDPA is barely slower on them, while a
        # transposing copy measured 5x slower with two threads than with one.
        q = query.transpose(0, 1).unsqueeze(0)
        if fresh and (window is None or window >= seq_len):
            k, v = (t.transpose(0, 1).unsqueeze(0) for t in (key, value))
            mask = None
        else:
            first = 0 if window is None else max(0, seq_len - query_len - window + 1)
            first_block = first // spec.block_size
            ids = block_ids[first_block : -(-seq_len // spec.block_size)].long().clamp(min=0)
            start = first_block * spec.block_size
            index = head_rows(ids.unsqueeze(0), spec.num_kv_heads).flatten()
            cache_rows = kv_cache.view(2, -1, spec.block_size * spec.head_dim)
            shape = (1, spec.num_kv_heads, ids.numel() * spec.block_size, spec.head_dim)
            k_tiles = cache_rows[0].index_select(0, index)
            k = k_tiles_as_rows(k_tiles, 1, spec, ids.numel())[:, :, : seq_len - start]
            v = cache_rows[1].index_select(0, index).view(shape)[:, :, : seq_len - start]
            q_pos = torch.arange(seq_len - query_len, seq_len).unsqueeze(1)
            k_pos = torch.arange(start, seq_len).unsqueeze(0)
            mask = k_pos <= q_pos
            if window is not None:
                mask &= k_pos > q_pos - window
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=spec.scale, enable_gqa=True
        )
        return o.squeeze(0).transpose(0, 1)


def k_tiles_as_rows(tiles: torch.Tensor, num_rows: int, spec, num_blocks: int) -> torch.Tensor:
    """Gathered K tiles (``[rows * kv_heads * num_blocks, head_dim * block_size]``, each a
    transposed ``[head_dim, block_size]`` tile) as ``[rows, kv_heads, num_blocks * block_size,
    head_dim]`` token rows, the layout SDPA reads."""
    k = tiles.view(num_rows, spec.num_kv_heads, num_blocks, spec.head_dim, spec.block_size)
    return k.transpose(3, 4).reshape(
        num_rows, spec.num_kv_heads, num_blocks * spec.block_size, spec.head_dim
    )


def head_rows(block_ids: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Cache row ids ``[R, kv_heads * num_blocks]`` of each KV head's part of the given blocks,
    KV head major, for the cache viewed as ``[2, num_blocks * kv_heads, block_size * head_dim]``."""
    heads = torch.arange(num_kv_heads).view(1, -1, 1)
    return (block_ids.unsqueeze(1) * num_kv_heads + heads).flatten(1)


def write_kv(key, value, kv_cache, slot_mapping) -> None:
    """Store new K/V at their slots with one ``index_copy_`` each; slots of -1 are skipped."""
    if slot_mapping.numel() == 0:
        return
    if int(slot_mapping.min()) < 0:
        keep = slot_mapping >= 0
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    _, _, num_kv_heads, block_size, head_dim = kv_cache.shape
    block, offset = slot_mapping // block_size, slot_mapping % block_size
    heads = torch.arange(num_kv_heads).unsqueeze(0)
    tiles = block.unsqueeze(1) * num_kv_heads + heads  # [T, KVH]
    rows = (tiles * block_size + offset.unsqueeze(1)).flatten()
    flat = kv_cache.view(2, -1, head_dim)
    flat[1].index_copy_(0, rows, value.reshape(-1, head_dim).to(kv_cache.dtype))
    # K is stored transposed in its tile: element d of a token at tile * D * bs + d * bs + offset
    dims = torch.arange(head_dim) * block_size
    k_index = (tiles * (block_size * head_dim) + offset.unsqueeze(1)).unsqueeze(2) + dims
    kv_cache[0].view(-1).index_copy_(0, k_index.flatten(), key.reshape(-1).to(kv_cache.dtype))


def _compiled_path_fits(query, key, value, kv_cache) -> bool:
    """The compiled kernel takes one dtype throughout and token rows of contiguous heads."""
    dtype = kv_cache.dtype
    if query.dtype != dtype or key.dtype != dtype or value.dtype != dtype:
        return False
    return all(
        t.dim() == 3 and t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in (query, key, value)
    )
