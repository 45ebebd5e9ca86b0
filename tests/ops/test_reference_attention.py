"""octavo.ops.reference.paged_attention against dense causal SDPA on contiguous K/V.

Each request's whole sequence (context and new tokens) is made contiguous; its context is put
into shuffled cache blocks by hand; the paged call over a mixed batch must give, for each
request's new tokens, the last rows of a full causal prefill of that sequence.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from octavo.ops import reference
from octavo.platform.types import AttentionMetadata

# (num_computed_tokens, num_new_tokens) per request, in batch order: a prefill chunk after
# context, decodes, a fresh prompt, a one-token prompt.
MIXED = ((13, 1), (0, 9), (20, 6), (5, 1), (0, 1), (31, 1))


def dense_attention(q, k, v, scale, sliding_window=None):
    """Full-sequence causal attention ``[L, H, D]`` with SDPA; GQA by ``enable_gqa``."""
    length = q.shape[0]
    mask = torch.ones(length, length, dtype=torch.bool).tril()
    if sliding_window is not None:
        mask = mask.triu(-(sliding_window - 1))
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).float(),
        k.transpose(0, 1).float(),
        v.transpose(0, 1).float(),
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )
    return out.transpose(0, 1)


def paged_case(requests, num_heads, num_kv_heads, head_dim, block_size, dtype, num_padding=0):
    """Random sequences, a cache holding their context, and the metadata of the new tokens."""
    gen = torch.Generator().manual_seed(0)
    seqs = []
    for computed, new in requests:
        length = computed + new
        seqs.append(
            [
                torch.randn(length, h, head_dim, generator=gen).to(dtype)
                for h in (num_heads, num_kv_heads, num_kv_heads)
            ]
        )
    blocks_per_req = [-(-(c + n) // block_size) for c, n in requests]
    num_blocks = sum(blocks_per_req) + 2
    order = torch.randperm(num_blocks, generator=gen).tolist()
    block_table = torch.zeros(len(requests), max(blocks_per_req), dtype=torch.int32)
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    slots, queries, keys, values = [], [], [], []
    for r, ((computed, new), (q, k, v)) in enumerate(zip(requests, seqs)):
        block_table[r, : blocks_per_req[r]] = torch.tensor(order[: blocks_per_req[r]])
        order = order[blocks_per_req[r] :]
        for pos in range(computed + new):
            block, offset = int(block_table[r, pos // block_size]), pos % block_size
            if pos < computed:
                cache[0, block, offset], cache[1, block, offset] = k[pos], v[pos]
            else:
                slots.append(block * block_size + offset)
        queries.append(q[computed:]), keys.append(k[computed:]), values.append(v[computed:])
    query_lens = [n for _, n in requests]
    metadata = AttentionMetadata(
        query_start_loc=torch.tensor([0] + query_lens).cumsum(0).to(torch.int32),
        seq_lens=torch.tensor([c + n for c, n in requests], dtype=torch.int32),
        block_table=block_table,
        slot_mapping=torch.tensor(slots + [-1] * num_padding, dtype=torch.int64),
        max_query_len=max(query_lens),
        max_seq_len=max(c + n for c, n in requests),
        num_actual_tokens=sum(query_lens),
    )

    def pad(t):
        return torch.cat([t, torch.randn(num_padding, *t.shape[1:], generator=gen).to(dtype)])

    q, k, v = (pad(torch.cat(x)) for x in (queries, keys, values))
    return seqs, cache, metadata, (q, k, v)


# Every block size with every head mapping, and the sliding windows with every head mapping.
CASES = [(b, h, None) for b in (1, 4, 16) for h in ((4, 4), (4, 2), (6, 1))] + [
    (4, h, w) for w in (3, 8) for h in ((4, 4), (4, 2), (6, 1))
]


@pytest.mark.parametrize(
    "block_size, heads, sliding_window", CASES, ids=lambda v: str(v).replace(" ", "")
)
def test_mixed_batch_matches_dense_causal_sdpa(block_size, heads, sliding_window):
    num_heads, num_kv_heads = heads
    head_dim, scale = 16, 0.3
    seqs, cache, metadata, (q, k, v) = paged_case(
        MIXED, num_heads, num_kv_heads, head_dim, block_size, torch.float32
    )
    out = reference.paged_attention(q, k, v, cache, metadata, scale, sliding_window)
    start = 0
    for (computed, new), (sq, sk, sv) in zip(MIXED, seqs):
        expected = dense_attention(sq, sk, sv, scale, sliding_window)[computed:]
        torch.testing.assert_close(out[start : start + new], expected, atol=1e-5, rtol=1e-5)
        start += new


def test_bfloat16_is_computed_in_float32_and_rounded_once():
    seqs, cache, metadata, (q, k, v) = paged_case(MIXED, 4, 2, 16, 4, torch.bfloat16)
    out = reference.paged_attention(q, k, v, cache, metadata, 0.25)
    assert out.dtype == torch.bfloat16
    start = 0
    for (computed, new), (sq, sk, sv) in zip(MIXED, seqs):
        expected = dense_attention(sq, sk, sv, 0.25)[computed:].to(torch.bfloat16)
        torch.testing.assert_close(out[start : start + new], expected, atol=8e-3, rtol=8e-3)
        start += new


def test_new_kv_is_written_through_slot_mapping_and_padding_is_skipped():
    seqs, cache, metadata, (q, k, v) = paged_case(MIXED, 4, 2, 8, 4, torch.float32, num_padding=3)
    before = cache.clone()
    out = reference.paged_attention(q, k, v, cache, metadata, 0.3)
    flat_before = before.view(2, -1, 2, 8)
    flat_after = cache.view(2, -1, 2, 8)
    written = metadata.slot_mapping[metadata.slot_mapping >= 0]
    n = metadata.num_actual_tokens
    assert torch.equal(flat_after[0, written], k[:n]) and torch.equal(flat_after[1, written], v[:n])
    untouched = torch.ones(flat_after.shape[1], dtype=torch.bool)
    untouched[written] = False
    assert torch.equal(flat_after[:, untouched], flat_before[:, untouched])
    assert torch.equal(out[n:], torch.zeros_like(out[n:])), "padding rows are zero"


def test_empty_batch():
    metadata = AttentionMetadata(
        query_start_loc=torch.zeros(1, dtype=torch.int32),
        seq_lens=torch.zeros(0, dtype=torch.int32),
        block_table=torch.zeros(0, 4, dtype=torch.int32),
        slot_mapping=torch.zeros(0, dtype=torch.int64),
        max_query_len=0,
        max_seq_len=0,
    )
    cache = torch.zeros(2, 4, 16, 2, 8)
    q = torch.zeros(0, 4, 8)
    k = v = torch.zeros(0, 2, 8)
    assert reference.paged_attention(q, k, v, cache, metadata, 0.3).shape == (0, 4, 8)
