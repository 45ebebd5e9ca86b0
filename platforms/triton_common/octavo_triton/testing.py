"""Test support for the Triton kernels, beside the conformance suite
(``octavo.testing.conformance``, which checks every platform's kernels against
``octavo.ops.reference``).

What is here is what the Triton platforms promise beyond the suite, and the inputs their own
tests and the benchmark build: random flat batches for paged attention, a units-in-the-last-place
comparison, and seeded sampling cases for the one property the suite leaves open (other samplers
draw differently): the Triton samplers draw exactly the reference's tokens from the same
generators. Used by the cuda and rocm test folders and ``octavo_cuda.bench``.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch

from octavo.ops import reference
from octavo.platform import AttentionMetadata, SamplingMetadata


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


@dataclasses.dataclass(frozen=True)
class SamplingCase:
    """Per-row sampling parameters; rows with a seed get their own generator."""

    name: str
    temperature: Sequence[float]
    top_k: Sequence[int]
    top_p: Sequence[float]
    min_p: Sequence[float]
    seeds: Sequence[Optional[int]]


SAMPLING_CASES = (
    SamplingCase(
        "all-filters-mixed",
        (0.0, 1.0, 0.7, 1.3, 1.0, 0.5),
        (0, 5, 0, 20, 3, 0),
        (1.0, 1.0, 0.8, 0.5, 1.0, 0.9),
        (0.0, 0.0, 0.0, 0.1, 0.2, 0.05),
        (None, 1, 2, 3, None, 5),
    ),
    SamplingCase("top-k-only", (1.0, 0.8, 2.0), (1, 2, 10), (1.0,) * 3, (0.0,) * 3, (7, 8, 9)),
    SamplingCase("top-p-only", (1.0, 1.0, 0.6), (0,) * 3, (0.3, 0.95, 0.6), (0.0,) * 3, (4, 5, 6)),
    SamplingCase(
        "min-p-only", (1.0, 1.5, 0.9), (0,) * 3, (1.0,) * 3, (0.3, 0.05, 0.5), (1, 2, None)
    ),
    SamplingCase(
        "temperature-only",
        (1.0, 0.5, 0.0, 2.0),
        (0,) * 4,
        (1.0,) * 4,
        (0.0,) * 4,
        (3, None, None, 4),
    ),
)


def sampling_metadata(case: SamplingCase, device, seed: int) -> SamplingMetadata:
    """The case's metadata on ``device``, with fresh generators seeded from ``seed``."""
    generators = {
        row: torch.Generator(device=device).manual_seed(1000 * seed + s)
        for row, s in enumerate(case.seeds)
        if s is not None
    }
    temperature = torch.tensor(case.temperature, device=device)
    return SamplingMetadata(
        temperature=temperature,
        top_k=torch.tensor(case.top_k, dtype=torch.int32, device=device),
        top_p=torch.tensor(case.top_p, device=device),
        min_p=torch.tensor(case.min_p, device=device),
        generators=generators,
        all_greedy=bool((temperature == 0).all()),
        all_random=bool((temperature > 0).all()),
        no_top_k=all(k <= 0 for k in case.top_k),
        no_top_p=all(p >= 1.0 for p in case.top_p),
        no_min_p=all(p <= 0.0 for p in case.min_p),
    )


def random_logits(num_rows: int, vocab_size: int, device, seed: int = 0) -> torch.Tensor:
    """Spread-out float32 logits with a tie for the largest value in row 0."""
    logits = torch.randn(num_rows, vocab_size, generator=torch.Generator().manual_seed(seed)) * 3
    logits[0, 3] = logits[0, 9] = 20.0
    return logits.to(device)


def assert_draws_like_reference(sampler, device, case: SamplingCase, logits, seeds=(0, 1)):
    """``sampler`` draws token for token what ``octavo.ops.reference.sample`` draws from the
    same generators (the global generator is re-seeded alike for rows without one)."""
    for seed in seeds:
        torch.manual_seed(seed)
        got = sampler(logits, sampling_metadata(case, device, seed))
        torch.manual_seed(seed)
        expected = reference.sample(logits, sampling_metadata(case, device, seed))
        assert got.dtype == torch.int64
        assert got.tolist() == expected.tolist(), (
            f"{case.name}, seed {seed}: {got.tolist()} != {expected.tolist()}"
        )
