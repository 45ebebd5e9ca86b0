"""Time the cpu platform's kernels against octavo.ops.reference and a dense SDPA baseline.

    .venv/bin/python benchmarks/cpu_kernels.py [--dtype float32 bfloat16] [--repeats 7]
        [--threads N] [--only attention rms_norm sampler bitmask]

Shapes are those of a ~100M Llama (12 query heads, 4 KV heads, head_dim 64, hidden 768, vocab
32000): decode of 64 requests with 512 tokens of context each, prefill of 8 fresh 512-token
prompts, a mixed step (one 256-token chunk after 256 tokens of context beside 63 decodes),
and a ragged decode (contexts uniform in 64..640).
The dense baselines are single SDPA calls on contiguous K/V, which no paged kernel reads. Variants
are timed round-robin (so a busy machine slows all alike) and the best and median of
``--repeats`` rounds are printed, in milliseconds.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

# ruff: noqa: I001 - octavo comes before torch: it sets OMP_WAIT_POLICY before OpenMP loads
import octavo  # noqa: F401
import torch
import torch.nn.functional as F

from octavo.ops import reference
from octavo.platform.types import AttentionMetadata, AttentionSpec, SamplingMetadata
from octavo_cpu.attention import CpuAttentionBackend
from octavo_cpu.rms_norm import make_rms_norm
from octavo_cpu.sampler import sample
from octavo_cpu.token_bitmask import TokenBitmaskKernel

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, HIDDEN, VOCAB = 12, 4, 64, 768, 32000


def time_round_robin(variants: dict[str, Callable[[], object]], repeats: int) -> dict[str, list]:
    """Seconds per call of each variant, one round of every variant at a time."""
    for fn in variants.values():
        fn()
    times: dict[str, list] = {name: [] for name in variants}
    order = list(variants.items())
    for round_index in range(repeats):
        # Alternate the order so no variant always runs just after a cache-evicting one.
        for name, fn in order if round_index % 2 == 0 else order[::-1]:
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def report(title: str, times: dict[str, list]) -> None:
    print(f"\n{title}")
    for name, samples in times.items():
        best, median = min(samples) * 1e3, statistics.median(samples) * 1e3
        print(f"  {name:<28} best {best:9.2f} ms   median {median:9.2f} ms")


def paged_step(requests, block_size, dtype, generator):
    """A reference-layout cache and the metadata of each request's new tokens.

    ``requests`` is a list of ``(num_computed_tokens, num_new_tokens)``."""
    blocks = [-(-(c + n) // block_size) for c, n in requests]
    num_blocks = sum(blocks) + 1
    order = torch.randperm(num_blocks, generator=generator)
    block_table = torch.zeros(len(requests), max(blocks), dtype=torch.int32)
    start = 0
    for r, n in enumerate(blocks):
        block_table[r, :n] = order[start : start + n]
        start += n
    cache = torch.randn(2, num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM, generator=generator)
    slots = []
    for r, (computed, new) in enumerate(requests):
        pos = torch.arange(computed, computed + new)
        slots.append(block_table[r].long()[pos // block_size] * block_size + pos % block_size)
    query_lens = [n for _, n in requests]
    metadata = AttentionMetadata(
        query_start_loc=torch.tensor([0] + query_lens).cumsum(0).to(torch.int32),
        seq_lens=torch.tensor([c + n for c, n in requests], dtype=torch.int32),
        block_table=block_table,
        slot_mapping=torch.cat(slots),
        max_query_len=max(query_lens),
        max_seq_len=max(c + n for c, n in requests),
    )
    num_tokens = sum(query_lens)
    q = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM, generator=generator).to(dtype)
    k = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=generator).to(dtype)
    v = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=generator).to(dtype)
    return cache.to(dtype), metadata, q, k, v


def dense_baselines(requests, dtype, generator):
    """One SDPA call over contiguous K/V of the same shapes (every request equally long):
    with ``enable_gqa``, and for decodes also with the query heads of a KV head folded into
    the query length (the faster form, which the paged kernel uses too)."""
    (computed, new), num_reqs = requests[0], len(requests)
    assert all(r == requests[0] for r in requests), "the dense baseline needs equal requests"
    length = computed + new
    q = torch.randn(num_reqs, NUM_HEADS, new, HEAD_DIM, generator=generator).to(dtype)
    k = torch.randn(num_reqs, NUM_KV_HEADS, length, HEAD_DIM, generator=generator).to(dtype)
    v = torch.randn(num_reqs, NUM_KV_HEADS, length, HEAD_DIM, generator=generator).to(dtype)
    causal = new > 1 and computed == 0
    baselines = {
        "dense SDPA gqa": lambda: F.scaled_dot_product_attention(
            q, k, v, is_causal=causal, enable_gqa=True
        )
    }
    if new == 1:
        folded = q.view(num_reqs, NUM_KV_HEADS, NUM_HEADS // NUM_KV_HEADS, HEAD_DIM)
        baselines["dense SDPA folded heads"] = lambda: F.scaled_dot_product_attention(folded, k, v)
    return baselines


def bench_attention(name, requests, dtype, block_size, repeats, with_dense=True):
    generator = torch.Generator().manual_seed(0)
    cache, metadata, q, k, v = paged_step(requests, block_size, dtype, generator)
    spec = AttentionSpec(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, dtype, block_size, HEAD_DIM**-0.5)
    backend = CpuAttentionBackend(spec)
    cpu_cache = torch.randn(backend.kv_cache_shape(cache.shape[1]), generator=generator).to(dtype)
    variants = {
        "cpu paged": lambda: backend.forward(q, k, v, cpu_cache, metadata),
        "reference paged": lambda: reference.paged_attention(q, k, v, cache, metadata, spec.scale),
    }
    if with_dense:
        variants.update(dense_baselines(requests, dtype, generator))
    report(f"attention {name}, {dtype}, block {block_size}", time_round_robin(variants, repeats))


def bench_rms_norm(dtype, num_tokens, repeats):
    x, residual = torch.randn(2, num_tokens, HIDDEN).to(dtype)
    weight = (1 + 0.1 * torch.randn(HIDDEN)).to(dtype)
    fn = make_rms_norm(HIDDEN, 1e-5, dtype)
    variants = {
        "cpu": lambda: fn(x, weight),
        "reference": lambda: reference.rms_norm(x, weight, 1e-5),
        "cpu + residual": lambda: fn(x, weight, residual),
        "reference + residual": lambda: reference.rms_norm(x, weight, 1e-5, residual),
    }
    report(f"rms_norm {num_tokens} x {HIDDEN}, {dtype}", time_round_robin(variants, repeats))


def sampling_metadata(num_reqs, top_k=0, top_p=1.0, min_p=0.0, temperature=0.8):
    return SamplingMetadata(
        temperature=torch.full((num_reqs,), temperature),
        top_k=torch.full((num_reqs,), top_k, dtype=torch.int32),
        top_p=torch.full((num_reqs,), top_p),
        min_p=torch.full((num_reqs,), min_p),
        all_greedy=temperature == 0,
        all_random=temperature > 0,
        no_top_k=top_k == 0,
        no_top_p=top_p >= 1.0,
        no_min_p=min_p == 0.0,
    )


def bench_sampler(num_reqs, repeats):
    logits = torch.randn(num_reqs, VOCAB) * 3
    cases = {
        "greedy": sampling_metadata(num_reqs, temperature=0.0),
        "temperature": sampling_metadata(num_reqs),
        "top-k 50": sampling_metadata(num_reqs, top_k=50),
        "top-k 50 + top-p 0.9": sampling_metadata(num_reqs, top_k=50, top_p=0.9),
        "top-p 0.9": sampling_metadata(num_reqs, top_p=0.9),
        "min-p 0.05": sampling_metadata(num_reqs, min_p=0.05),
    }
    variants = {}
    for case, meta in cases.items():
        variants[f"cpu {case}"] = lambda meta=meta: sample(logits, meta)
        variants[f"reference {case}"] = lambda meta=meta: reference.sample(logits, meta)
    report(f"sampler {num_reqs} x {VOCAB}", time_round_robin(variants, repeats))


def bench_bitmask(num_reqs, repeats):
    logits = torch.randn(num_reqs, VOCAB)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (num_reqs, -(-VOCAB // 32)), dtype=torch.int64)
    bitmask = bitmask.to(torch.int32)
    apply = TokenBitmaskKernel()
    variants = {
        "cpu": lambda: apply(logits.clone(), bitmask),
        "reference": lambda: reference.apply_token_bitmask(logits.clone(), bitmask),
        "clone alone": lambda: logits.clone(),
    }
    report(f"token bitmask {num_reqs} x {VOCAB}", time_round_robin(variants, repeats))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--only", nargs="+", default=["attention", "rms_norm", "sampler", "bitmask"]
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    ragged = torch.randint(64, 641, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    attention_cases = (
        ("decode 64 x ctx 512", [(511, 1)] * 64, True),
        ("decode 64 x ctx 64..640 (ragged)", [(n - 1, 1) for n in ragged], False),
        ("prefill 8 x 512", [(0, 512)] * 8, True),
        ("mixed 256+256 chunk + 63 decodes", [(256, 256)] + [(511, 1)] * 63, False),
    )
    for dtype in (getattr(torch, name) for name in args.dtype):
        if "attention" in args.only:
            for name, requests, with_dense in attention_cases:
                bench_attention(name, requests, dtype, args.block_size, args.repeats, with_dense)
        if "rms_norm" in args.only:
            bench_rms_norm(dtype, 64, args.repeats)
            bench_rms_norm(dtype, 4096, args.repeats)
    if "sampler" in args.only:
        bench_sampler(64, args.repeats)
    if "bitmask" in args.only:
        bench_bitmask(64, args.repeats)


if __name__ == "__main__":
    main()
