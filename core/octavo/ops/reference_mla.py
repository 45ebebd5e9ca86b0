"""The multi-head latent attention oracle (re-exported by ``octavo.ops.reference``): one cached
row per token (latent, then rotary key), attention in the latent space, a loop over requests."""

from __future__ import annotations

import torch

from octavo.platform.types import AttentionMetadata, MLAAttentionBackend, MLASpec


def write_mla_rows(kv_row: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor):
    """Store each new token's row at its slot (layout ``[num_blocks, block_size, width]``); a
    slot of -1 is padding and is skipped."""
    flat = kv_cache.view(-1, kv_cache.shape[-1])
    valid = slot_mapping >= 0
    flat[slot_mapping[valid]] = kv_row[: slot_mapping.shape[0]][valid].to(kv_cache.dtype)


def mla_attention(
    query: torch.Tensor,
    kv_row: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    spec: MLASpec,
) -> torch.Tensor:
    """``[T, num_heads, kv_lora_rank]``: each new token of request ``r`` at position ``p``
    attends to the request's rows ``0..p`` (read through ``block_table[r]``) with scores
    ``query . row * scale`` and takes the softmax-weighted sum of their latents (the first
    ``kv_lora_rank`` of each row). Float32 inside, ``query.dtype`` out; padding rows zero."""
    write_mla_rows(kv_row, kv_cache, metadata.slot_mapping)
    block_size = kv_cache.shape[1]
    out = query.new_zeros(query.shape[0], query.shape[1], spec.kv_lora_rank)
    qsl = metadata.query_start_loc.tolist()
    for r, seq_len in enumerate(metadata.seq_lens.tolist()):
        start, end = qsl[r], qsl[r + 1]
        if end == start:
            continue
        blocks = metadata.block_table[r, : -(-seq_len // block_size)].long()
        rows = kv_cache[blocks].reshape(-1, spec.row_width)[:seq_len].float()
        scores = torch.einsum("qhd,kd->hqk", query[start:end].float(), rows) * spec.scale
        q_pos = torch.arange(seq_len - (end - start), seq_len, device=query.device)
        masked = torch.arange(seq_len, device=query.device)[None, :] > q_pos[:, None]
        probs = torch.softmax(scores.masked_fill(masked, float("-inf")), dim=-1)
        latent = rows[:, : spec.kv_lora_rank]
        out[start:end] = torch.einsum("hqk,kd->qhd", probs, latent).to(query.dtype)
    return out


class ReferenceMLABackend(MLAAttentionBackend):
    """:func:`mla_attention` as a platform's backend (the core's, where a platform has none)."""

    name = "reference-mla"

    def forward(self, query, kv_row, kv_cache, metadata):
        return mla_attention(query, kv_row, kv_cache, metadata, self.spec)
