"""Kernel throughput on one GPU: each cuda kernel against the torch reference on the same device.

    python -m octavo_cuda.bench            # on an NVIDIA GPU (a minute or two)
    python -m octavo_cuda.bench --tiny     # a smoke run of the code paths (the interpreter too)

Prints one line per case: milliseconds per call for the Triton kernel and for
``octavo.ops.reference``, and the speed-up. Every figure in a note comes with this command line.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from typing import Callable

import torch

from octavo.ops import reference
from octavo.platform import Platform
from octavo.platform.types import AttentionSpec, SamplingMetadata
from octavo_triton.testing import random_paged_batch, to_device


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Case sizes: ``full`` on a GPU, ``tiny`` for a smoke run."""

    decode_reqs: int
    decode_context: int
    prefill_reqs: int
    prefill_len: int
    norm_tokens: int
    hidden: int
    sample_rows: int
    vocab: int


FULL = Sizes(64, 2048, 4, 1024, 4096, 4096, 256, 128256)
TINY = Sizes(3, 40, 2, 24, 8, 64, 4, 300)


def time_call(fn: Callable[[], object], device: torch.device, min_seconds: float = 0.2) -> float:
    """Milliseconds per call: CUDA events on a GPU, the wall clock otherwise; warm-up first."""
    fn()
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=10, rep=int(min_seconds * 1000)))
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < min_seconds or calls < 2:
        fn()
        calls += 1
    return (time.perf_counter() - start) * 1000 / calls


def attention_cases(platform: Platform, device, sizes: Sizes):
    """Decodes over long contexts, then long prefills: (name, kernel call, reference call)."""
    spec = AttentionSpec(32, 8, 128, torch.bfloat16, 16, 128**-0.5)
    backend = platform.attention_backend(spec)
    shapes = (
        ("attention decode", [1] * sizes.decode_reqs, [sizes.decode_context] * sizes.decode_reqs),
        ("attention prefill", [sizes.prefill_len] * sizes.prefill_reqs, [0] * sizes.prefill_reqs),
    )
    for name, query_lens, context_lens in shapes:
        b = to_device(
            random_paged_batch(query_lens, context_lens, 32, 8, 128, 16, torch.bfloat16), device
        )
        yield (
            f"{name} R={len(query_lens)} "
            f"ctx={max(q + c for q, c in zip(query_lens, context_lens))}",
            lambda b=b: backend.forward(b.query, b.key, b.value, b.kv_cache, b.metadata),
            lambda b=b: reference.paged_attention(
                b.query, b.key, b.value, b.kv_cache, b.metadata, spec.scale
            ),
        )


def other_cases(platform: Platform, device, sizes: Sizes):
    """Fused add + RMSNorm and the sampler with every filter on."""
    x, residual = (
        torch.randn(sizes.norm_tokens, sizes.hidden, device=device, dtype=torch.bfloat16)
        for _ in range(2)
    )
    weight = torch.ones(sizes.hidden, device=device, dtype=torch.bfloat16)
    norm = platform.rms_norm(sizes.hidden, 1e-6, torch.bfloat16)
    yield (
        f"fused add+rms_norm {sizes.norm_tokens}x{sizes.hidden}",
        lambda: norm(x, weight, residual),
        lambda: reference.rms_norm(x, weight, 1e-6, residual),
    )
    rows = sizes.sample_rows
    logits = torch.randn(rows, sizes.vocab, device=device) * 4
    metadata = SamplingMetadata(
        temperature=torch.full((rows,), 0.8, device=device),
        top_k=torch.full((rows,), 50, device=device, dtype=torch.int32),
        top_p=torch.full((rows,), 0.9, device=device),
        min_p=torch.full((rows,), 0.05, device=device),
        all_random=True,
        no_top_k=False,
        no_top_p=False,
        no_min_p=False,
    )
    sampler = platform.sampler(sizes.vocab)
    yield (
        f"sampler top-k/top-p/min-p {rows}x{sizes.vocab}",
        lambda: sampler(logits, metadata),
        lambda: reference.sample(logits, metadata),
    )


def fp8_and_speculation_cases(platform: Platform, device, sizes: Sizes):
    """FP8 scaled matmul (per-token x per-channel scales, into bf16) and the rejection sampler
    (4 drafts per request with draft probabilities, half the requests greedy)."""
    from octavo.models.layers.fp8 import quantize_rows

    m, k = sizes.norm_tokens, sizes.hidden
    a, scale_a = quantize_rows(torch.randn(m, k, device=device))
    w, scale_w = quantize_rows(torch.randn(k, k, device=device))
    scaled_mm = platform.scaled_mm()
    yield (
        f"fp8 scaled_mm {m}x{k}x{k}",
        lambda: scaled_mm(a, w.t(), scale_a, scale_w.view(1, -1), torch.bfloat16),
        lambda: reference.scaled_mm(a, w.t(), scale_a, scale_w.view(1, -1), torch.bfloat16),
    )
    rows, drafts = sizes.sample_rows, 4
    counts = [drafts] * rows
    target = torch.softmax(torch.randn(rows * (drafts + 1), sizes.vocab, device=device) * 3, -1)
    draft = torch.softmax(torch.randn(rows * drafts, sizes.vocab, device=device) * 3, -1)
    ids = torch.randint(0, sizes.vocab, (rows * drafts,), device=device)
    temperature = (torch.arange(rows, device=device) % 2).float()
    uniforms, noise = reference.draw_rejection_randoms(counts, sizes.vocab, device=device)
    args = (ids, counts, draft, target, temperature, uniforms, noise)
    verify = platform.rejection_sampler()
    yield (
        f"rejection sampler {rows}x{drafts} drafts, V={sizes.vocab}",
        lambda: verify(*args),
        lambda: reference.rejection_sample(*args),
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--tiny", action="store_true", help="small shapes: a smoke run of the code paths"
    )
    args = parser.parse_args(argv)
    platform = Platform.select(device="cuda")
    device = platform.device_init(0)
    sizes = TINY if args.tiny else FULL
    print(f"# {platform.info.reason}; torch {torch.__version__}")
    if device.type == "cuda":
        print(f"# {torch.cuda.get_device_name(device)}")
    for cases in (attention_cases, other_cases, fp8_and_speculation_cases):
        for name, kernel, ref in cases(platform, device, sizes):
            kernel_ms, ref_ms = time_call(kernel, device), time_call(ref, device)
            print(
                f"{name:48} triton {kernel_ms:9.3f} ms   reference {ref_ms:9.3f} ms   "
                f"x{ref_ms / kernel_ms:6.1f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
