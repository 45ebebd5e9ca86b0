"""Checks of a platform's resolved kernels against ``octavo.ops.reference``, shared by the cuda
and rocm test folders. Each check builds its inputs on the CPU, runs the platform's kernel on
the platform's device and the reference on the same values, and asserts what must agree.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch

from octavo.ops import reference
from octavo.platform import Platform
from octavo.platform.types import AttentionSpec, SamplingMetadata
from octavo_triton.testing import assert_close, random_paged_batch, to_device


@dataclasses.dataclass(frozen=True)
class AttentionCase:
    """A ragged batch shape for paged attention."""

    name: str
    query_lens: Sequence[int]
    context_lens: Sequence[int]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    sliding_window: Optional[int] = None
    num_pad_tokens: int = 0


SPLIT_KV_CASES = (
    AttentionCase(
        "decodes-long-contexts", (1, 1, 1), (150, 37, 90), 8, 2, 32, 16, num_pad_tokens=2
    ),
    AttentionCase("short-chunks-sliding-window", (2, 1), (120, 70), 4, 1, 16, 8, sliding_window=50),
)

ATTENTION_CASES = (
    AttentionCase(
        "mixed-prefill-decode", (1, 5, 1, 7), (9, 0, 20, 3), 4, 2, 32, 8, num_pad_tokens=2
    ),
    AttentionCase("decodes-gqa4-odd-head-dim", (1, 1, 1), (15, 33, 0), 8, 2, 24, 16),
    AttentionCase("prefill-mha", (12,), (0,), 2, 2, 16, 8),
    AttentionCase("chunk-spans-query-blocks", (13, 1), (37, 64), 4, 1, 32, 16),
    AttentionCase("empty-request", (0, 3), (5, 2), 2, 1, 16, 8),
    AttentionCase("sliding-window", (6, 2), (10, 40), 4, 1, 16, 8, sliding_window=7),
)


def check_attention(backend_for, device, dtype: torch.dtype, case: AttentionCase, seed: int = 0):
    """The paged attention of ``backend_for(spec)`` (e.g. ``platform.attention_backend``) writes
    the KV cache exactly as the reference does and returns the reference's output (within an
    ulp in 16-bit dtypes)."""
    spec = AttentionSpec(
        case.num_heads,
        case.num_kv_heads,
        case.head_dim,
        dtype,
        case.block_size,
        case.head_dim**-0.5,
        case.sliding_window,
    )
    backend = backend_for(spec)
    batch = random_paged_batch(
        case.query_lens,
        case.context_lens,
        case.num_heads,
        case.num_kv_heads,
        case.head_dim,
        case.block_size,
        dtype,
        case.num_pad_tokens,
        seed,
    )
    assert backend.kv_cache_shape(batch.kv_cache.shape[1]) == tuple(batch.kv_cache.shape)
    ref_cache = batch.kv_cache.clone()
    expected = reference.paged_attention(
        batch.query,
        batch.key,
        batch.value,
        ref_cache,
        batch.metadata,
        spec.scale,
        spec.sliding_window,
    )
    on_device = to_device(batch, device)
    out = backend.forward(
        on_device.query, on_device.key, on_device.value, on_device.kv_cache, on_device.metadata
    )
    assert torch.equal(on_device.kv_cache.cpu(), ref_cache), (
        "KV cache differs from the reference's write"
    )
    assert_close(out, expected)


def check_attention_strided_query(platform: Platform, device, dtype: torch.dtype):
    """Query, key and value may be column slices of one fused QKV projection output."""
    case = ATTENTION_CASES[0]
    batch = random_paged_batch(case.query_lens, case.context_lens, 4, 2, 32, 8, dtype, 2, seed=3)
    fused = torch.cat([batch.query.flatten(1), batch.key.flatten(1), batch.value.flatten(1)], 1)
    q, k, v = fused.to(device).split([4 * 32, 2 * 32, 2 * 32], dim=1)
    spec = AttentionSpec(4, 2, 32, dtype, 8, 32**-0.5)
    ref_cache = batch.kv_cache.clone()
    expected = reference.paged_attention(
        batch.query, batch.key, batch.value, ref_cache, batch.metadata, spec.scale
    )
    on_device = to_device(batch, device)
    out = platform.attention_backend(spec).forward(
        q.view(-1, 4, 32),
        k.view(-1, 2, 32),
        v.view(-1, 2, 32),
        on_device.kv_cache,
        on_device.metadata,
    )
    assert torch.equal(on_device.kv_cache.cpu(), ref_cache)
    assert_close(out, expected)


def check_rms_norm(
    platform: Platform, device, dtype: torch.dtype, hidden: int, with_residual: bool
):
    """RMSNorm (and the fused residual add) match the reference: the sum exactly, the
    normalised output within an ulp; leading dimensions are kept."""
    gen = torch.Generator().manual_seed(hidden)
    x = (torch.randn(2, 3, hidden, generator=gen) * 4).to(dtype)
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(dtype)
    residual = torch.randn(2, 3, hidden, generator=gen).to(dtype) if with_residual else None
    fn = platform.rms_norm(hidden, 1e-6, dtype)
    expected = reference.rms_norm(x, weight, 1e-6, residual)
    args = (x.to(device), weight.to(device)) + ((residual.to(device),) if with_residual else ())
    got = fn(*args)
    if with_residual:
        assert torch.equal(got[1].cpu(), expected[1]), "x + residual differs from the reference"
        got, expected = got[0], expected[0]
    assert_close(got, expected)


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


def check_sampler(
    platform: Platform, device, case: SamplingCase, vocab_size: int = 64, seeds=(0, 1)
):
    """Token for token what the reference samples from the same generators (the global
    generator is re-seeded alike for rows without a seed of their own)."""
    sampler = platform.sampler(vocab_size)
    logits = random_logits(len(case.temperature), vocab_size, device)
    for seed in seeds:
        torch.manual_seed(seed)
        got = sampler(logits, sampling_metadata(case, device, seed))
        torch.manual_seed(seed)
        expected = reference.sample(logits, sampling_metadata(case, device, seed))
        assert got.dtype == torch.int64
        assert got.tolist() == expected.tolist(), (
            f"seed {seed}: {got.tolist()} != {expected.tolist()}"
        )


def check_greedy(platform: Platform, device, vocab_size: int = 300):
    """All-greedy batches return the argmax, the lowest index on ties, over several chunks."""
    logits = random_logits(3, vocab_size, device)
    logits[2, vocab_size - 1] = 50.0  # the last chunk's last token
    case = SamplingCase("greedy", (0.0,) * 3, (0,) * 3, (1.0,) * 3, (0.0,) * 3, (None,) * 3)
    got = platform.sampler(vocab_size)(logits, sampling_metadata(case, device, 0))
    assert got.tolist() == [3, int(logits[1].argmax()), vocab_size - 1]


def check_bitmask(
    platform: Platform, device, dtype: torch.dtype, vocab_size: int, use_indices: bool
):
    """Disallowed logits become -inf in place, the others are untouched; ``indices`` routes
    bitmask rows to logits rows."""
    gen = torch.Generator().manual_seed(vocab_size)
    logits = torch.randn(4, vocab_size, generator=gen).to(dtype)
    num_words = -(-vocab_size // 32)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, num_words), generator=gen, dtype=torch.int32)
    indices = torch.tensor([2, 0, 3]) if use_indices else None
    expected = logits.clone() if use_indices else logits[:3].clone()
    reference.apply_token_bitmask(expected, bitmask, indices)
    got = (logits if use_indices else logits[:3]).to(device)
    platform.apply_token_bitmask()(
        got, bitmask.to(device), None if indices is None else indices.to(device)
    )
    assert torch.equal(got.cpu(), expected)


def check_sampler_ties_across_chunks(sampler, device, vocab_size: int = 96):
    """Four ties for the top value, spread over several vocabulary chunks: top-k keeps every
    tie (as the reference does); top-p keeps ties in index order while the mass before each is
    below ``p`` (a stable sort's order: the reference's unstable sort leaves that open)."""
    logits = random_logits(4, vocab_size, device)
    ties = [5, 40, 70, 90]
    logits[:, ties] = 15.0
    case = SamplingCase(
        "ties", (1.0,) * 4, (2, 0, 3, 0), (1.0, 0.3, 1.0, 0.6), (0.0,) * 4, (1, 2, 3, 4)
    )
    drawn = {1: set(), 3: set()}
    for seed in range(2):
        got = sampler(logits, sampling_metadata(case, device, seed)).tolist()
        expected = reference.sample(logits, sampling_metadata(case, device, seed)).tolist()
        assert [got[0], got[2]] == [expected[0], expected[2]], f"seed {seed}: {got} != {expected}"
        drawn[1].add(got[1])
        drawn[3].add(got[3])
    assert drawn[1] <= set(ties[:2]) and drawn[3] <= set(ties[:3]), drawn


def check_generation_matches_cpu(platform_name: str, model_dir, monkeypatch):
    """End to end: ``LLM(model, device=platform_name)`` generates exactly the cpu platform's
    greedy tokens on a tiny model, with chunked prefills mixed with decodes in the same steps."""
    from octavo import LLM, SamplingParams
    from octavo_triton import runtime

    prompts = [
        [1] + [(7 * i + 3 * j) % 500 + 3 for j in range(n)] for i, n in enumerate((37, 5, 21, 2))
    ]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine_args = dict(
        kv_cache_memory="2MiB", max_num_seqs=4, max_num_batched_tokens=24, dtype="float32"
    )

    def generate(device: str) -> list[list[int]]:
        llm = LLM(str(model_dir), device=device, **engine_args)
        assert llm.engine.core.platform.name == device
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]

    expected = generate("cpu")
    if runtime.interpreting():
        monkeypatch.setenv(runtime.INTERPRET_DEVICE_ENV, platform_name)
    assert generate(platform_name) == expected


SCALED_MM_SHAPES = ((5, 40, 24), (33, 96, 17))  # (M, K, N): ragged tiles on every side


def check_scaled_mm(scaled_mm, device, out_dtype: torch.dtype, fp8_dtype=torch.float8_e4m3fn):
    """FP8 scaled matmul against the reference: per-tensor, per-token and per-channel scales,
    with and without bias; float32 accumulation, so only summation order differs."""
    gen = torch.Generator().manual_seed(11)
    for m, k, n in SCALED_MM_SHAPES:
        a = (torch.randn(m, k, generator=gen) * 4).to(fp8_dtype)
        b = (torch.randn(k, n, generator=gen) * 4).to(fp8_dtype)
        scales_a = (torch.tensor([0.02]), torch.rand(m, 1, generator=gen) / 10)
        scales_b = (torch.tensor([0.5]), torch.rand(1, n, generator=gen))
        for scale_a, scale_b in zip(scales_a, scales_b):
            for bias in (None, torch.randn(n, generator=gen).to(out_dtype)):
                expected = reference.scaled_mm(a, b, scale_a, scale_b, out_dtype, bias)
                got = scaled_mm(
                    a.to(device),
                    b.to(device),
                    scale_a.to(device),
                    scale_b.to(device),
                    out_dtype,
                    None if bias is None else bias.to(device),
                )
                assert got.dtype == out_dtype and got.shape == (m, n)
                assert_close(got, expected)


def check_per_token_quant(device, fp8_dtype=torch.float8_e4m3fn):
    """Dynamic per-token quantisation: ``scale = amax / fp8_max`` per row and ``q`` the
    round-to-nearest FP8 value of ``x / scale`` (as torch casts), zero rows included."""
    from octavo_triton.fp8 import make_per_token_quant

    fp8_max = torch.finfo(fp8_dtype).max
    x = torch.randn(7, 300, generator=torch.Generator().manual_seed(5)) * 3
    x[3] = 0.0
    q, scale = make_per_token_quant(fp8_dtype, block_k=128)(x.to(device))
    expected_scale = (x.abs().amax(1, keepdim=True) / fp8_max).clamp(min=1.0 / (fp8_max * 512.0))
    assert torch.equal(scale.cpu(), expected_scale)
    expected = (x / expected_scale).clamp(-fp8_max, fp8_max).to(fp8_dtype)
    assert torch.equal(q.cpu().float(), expected.float())


def check_rejection_sampler(rejection_sample, device):
    """Speculative-decoding verification equals the reference's from the same draws, with
    requests spread over several programs and the vocabulary over several chunks (when the
    sampler was built with small tiles), with and without draft probabilities."""
    from octavo.testing.conformance.rejection_cases import random_case

    counts = [2, 0, 4, 1, 3, 3, 0, 5, 1, 2, 4]
    for seed, with_draft_probs in ((0, False), (1, True)):
        ids, counts, draft, target, temperature, uniforms, noise = case = random_case(
            counts, 37, seed, with_draft_probs, greedy_rows=(0, 4, 7)
        )
        expected = reference.rejection_sample(*case)
        got = rejection_sample(
            ids.to(device),
            counts,
            None if draft is None else draft.to(device),
            target.to(device),
            temperature.to(device),
            uniforms.to(device),
            noise.to(device),
        )
        assert torch.equal(got.cpu(), expected), (
            f"seed {seed}: {got.tolist()} != {expected.tolist()}"
        )
