"""Paged attention on the host CPU: batched decodes, one SDPA call per prefill chunk.

The KV cache keeps the default layout ``[2, num_blocks, block_size, num_kv_heads, head_dim]``.
A step's new K/V go in with one ``index_copy_`` per tensor. Decode rows (one new token) of all
requests are served together: their context blocks are gathered through the block table into
a reused workspace (``index_select`` of whole blocks, a memcpy each) and attended with one
``scaled_dot_product_attention`` call whose boolean mask hides each row's padding; the grouped
query heads of a KV head ride along as that call's query length. Prefill chunks (several new
tokens) get one SDPA call each: a fresh prompt attends straight to its new K/V with
``is_causal``; a chunk after context reads its blocks and uses a lower-right causal mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from octavo.platform.types import AttentionBackend, AttentionMetadata

WORKSPACE_BYTES = 16 << 20
"""Decode rows are gathered in groups whose K+V stay under this size (cache-friendly, bounded)."""


class CpuAttentionBackend(AttentionBackend):
    """Paged attention for the cpu platform (mixed prefill chunks and decodes in one call)."""

    name = "cpu"

    def __init__(self, spec):
        super().__init__(spec)
        self._workspace = torch.empty(0, dtype=spec.dtype)

    def forward(self, query, key, value, kv_cache, metadata: AttentionMetadata):
        """Write the new K/V through ``slot_mapping``, then attend through ``block_table``."""
        num_tokens = metadata.num_actual_tokens
        if num_tokens < 0:
            num_tokens = query.shape[0]
        write_kv(key[:num_tokens], value[:num_tokens], kv_cache, metadata.slot_mapping[:num_tokens])
        out = torch.empty_like(query)
        out[num_tokens:].zero_()
        if metadata.num_reqs == 0 or num_tokens == 0:
            return out
        query_start_loc = metadata.query_start_loc
        query_lens = query_start_loc[1:] - query_start_loc[:-1]
        if metadata.max_query_len == 1:
            self._decode(query, kv_cache, metadata, None, out)
            return out
        is_decode = query_lens == 1
        decode_rows = is_decode.nonzero().flatten()
        if decode_rows.numel():
            self._decode(query, kv_cache, metadata, decode_rows, out)
        starts = query_start_loc.tolist()
        seq_lens = metadata.seq_lens.tolist()
        for row in (~is_decode & (query_lens > 0)).nonzero().flatten().tolist():
            start, end = starts[row], starts[row + 1]
            out[start:end] = self._prefill(
                query[start:end], key[start:end], value[start:end], kv_cache,
                metadata.block_table[row], seq_lens[row],
            )
        return out

    def _gather_buffer(self, numel: int) -> torch.Tensor:
        if self._workspace.numel() < numel:
            self._workspace = torch.empty(numel, dtype=self.spec.dtype)
        return self._workspace[:numel]

    def _decode(self, query, kv_cache, metadata, rows, out) -> None:
        """All one-token rows at once (in workspace-sized groups of requests)."""
        spec = self.spec
        block_size, num_kv_heads, head_dim = spec.block_size, spec.num_kv_heads, spec.head_dim
        if rows is None:
            tokens = metadata.query_start_loc[:-1].long()
            seq_lens = metadata.seq_lens.long()
            block_table = metadata.block_table
        else:
            tokens = metadata.query_start_loc[rows].long()
            seq_lens = metadata.seq_lens[rows].long()
            block_table = metadata.block_table[rows]
        first_block = torch.zeros_like(seq_lens)
        window = spec.sliding_window
        if window is not None:
            first_block = (seq_lens - window).clamp(min=0) // block_size
        num_blocks = int(((seq_lens + block_size - 1) // block_size - first_block).max())
        num_reqs = tokens.shape[0]
        block_bytes = 2 * block_size * num_kv_heads * head_dim * kv_cache.element_size()
        group = max(1, min(num_reqs, WORKSPACE_BYTES // (block_bytes * num_blocks)))
        offsets = torch.arange(num_blocks)
        # Past a row's last block the table holds stale or padding ids: clamp them to valid
        # blocks; what they hold is masked out.
        block_ids = block_table.long().gather(
            1, (first_block.unsqueeze(1) + offsets).clamp(max=block_table.shape[1] - 1)
        ).clamp_(min=0)
        positions = first_block.unsqueeze(1) * block_size + torch.arange(num_blocks * block_size)
        visible = positions < seq_lens.unsqueeze(1)
        if window is not None:
            visible &= positions >= (seq_lens - window).unsqueeze(1)
        num_groups = spec.num_heads // num_kv_heads
        q = query[tokens].view(num_reqs, num_kv_heads, num_groups, head_dim)
        blocks = kv_cache.view(2, kv_cache.shape[1], -1)
        for start in range(0, num_reqs, group):
            end = min(start + group, num_reqs)
            n = end - start
            ids = block_ids[start:end].flatten()
            buffer = self._gather_buffer(2 * ids.numel() * blocks.shape[2]).view(2, ids.numel(), -1)
            torch.index_select(blocks[0], 0, ids, out=buffer[0])
            torch.index_select(blocks[1], 0, ids, out=buffer[1])
            kv = buffer.view(2, n, num_blocks * block_size, num_kv_heads, head_dim)
            k, v = kv.transpose(2, 3)
            o = F.scaled_dot_product_attention(
                q[start:end], k, v, attn_mask=visible[start:end, None, None, :], scale=spec.scale
            )
            out[tokens[start:end]] = o.reshape(n, spec.num_heads, head_dim)

    def _prefill(self, query, key, value, kv_cache, block_ids, seq_len: int) -> torch.Tensor:
        """One request's chunk of new tokens attending causally to its context and itself."""
        spec = self.spec
        query_len = query.shape[0]
        window = spec.sliding_window
        fresh = seq_len == query_len and kv_cache.dtype == key.dtype
        if fresh and (window is None or window >= seq_len):
            k, v = key, value
            mask = None
        else:
            first = 0 if window is None else max(0, seq_len - query_len - window + 1)
            first_block = first // spec.block_size
            last_block = -(-seq_len // spec.block_size)
            ids = block_ids[first_block:last_block].long()
            start = first_block * spec.block_size
            k = kv_cache[0].index_select(0, ids).flatten(0, 1)[: seq_len - start]
            v = kv_cache[1].index_select(0, ids).flatten(0, 1)[: seq_len - start]
            q_pos = torch.arange(seq_len - query_len, seq_len).unsqueeze(1)
            k_pos = torch.arange(start, seq_len).unsqueeze(0)
            mask = k_pos <= q_pos
            if window is not None:
                mask &= k_pos > q_pos - window
        o = F.scaled_dot_product_attention(
            query.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
            attn_mask=mask, is_causal=mask is None, scale=spec.scale, enable_gqa=True,
        )
        return o.transpose(0, 1)


def write_kv(key, value, kv_cache, slot_mapping) -> None:
    """Store new K/V at their slots with one ``index_copy_`` each; slots of -1 are skipped."""
    if slot_mapping.numel() == 0:
        return
    if int(slot_mapping.min()) < 0:
        keep = slot_mapping >= 0
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    flat = kv_cache.view(2, -1, kv_cache.shape[-2], kv_cache.shape[-1])
    flat[0].index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, value.to(kv_cache.dtype))
