"""Time the cpu platform's batched LoRA kernels (shrink then expand, one call each) against
octavo.ops.reference's and against the base GEMM of the same projection.

    .venv/bin/python benchmarks/cpu_lora_kernels.py [--dtype float32 bfloat16] [--isa avx2]
        [--tokens 1 8 32] [--rank 16] [--slots 4] [--threads N] [--repeats 9]

Shapes are SmolLM2-135M's projections (hidden 576, intermediate 1536, 9 heads of 64, 3 KV
heads): q/o 576 -> 576, k/v 576 -> 192, gate/up 576 -> 1536, down 1536 -> 576. A decode step of
T tokens spreads them over the slots in turn (every token has an adapter). The base GEMM is
torch's F.linear of [T, K] against the projection's [N, K] weight in the same dtype. Variants
are timed round-robin (a busy machine slows all alike); the table gives the median of
``--repeats`` rounds, each the mean over enough calls to last about 2 ms, in microseconds.

OpenMP runs as in an engine (``import octavo`` sets OMP_WAIT_POLICY=PASSIVE: its threads sleep
between parallel regions), which the reference's many small torch ops and F.linear pay for on
two or more threads; OMP_WAIT_POLICY=ACTIVE in the environment times them spinning instead.
The compiled kernels run on their own work pool either way.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

# ruff: noqa: I001 - octavo comes before torch: it sets OMP_WAIT_POLICY before OpenMP loads
import octavo  # noqa: F401
import numpy as np
import torch
import torch.nn.functional as F

from octavo.lora.mapping import build_lora_mapping
from octavo.ops import reference
from octavo_cpu import kernels
from octavo_cpu.lora import make_lora_kernels

PROJECTIONS = (  # (name, K, N) of SmolLM2-135M
    ("q_proj / o_proj", 576, 576),
    ("k_proj / v_proj", 576, 192),
    ("gate / up_proj", 576, 1536),
    ("down_proj", 1536, 576),
)


def per_call(fn: Callable[[], object], seconds: float = 2e-3) -> Callable[[], float]:
    """A round of ``fn``: enough calls to last about ``seconds``; returns seconds per call."""
    start = time.perf_counter()
    fn()
    calls = max(1, int(seconds / max(time.perf_counter() - start, 1e-7)))

    def round_() -> float:
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - start) / calls

    return round_


def median_microseconds(variants: dict[str, Callable[[], object]], repeats: int) -> dict:
    rounds = {name: per_call(fn) for name, fn in variants.items()}
    samples: dict[str, list] = {name: [] for name in variants}
    order = list(rounds.items())
    for index in range(repeats):
        for name, round_ in order if index % 2 == 0 else order[::-1]:
            samples[name].append(round_())
    return {name: statistics.median(times) * 1e6 for name, times in samples.items()}


def lora_step(lora, num_tokens, k, n, rank, num_slots, dtype):
    """``fn()`` of shrink + expand through ``lora``, and of the base GEMM, on one step."""
    generator = torch.Generator().manual_seed(num_tokens + k + n)
    mapping = build_lora_mapping(np.arange(num_tokens) % num_slots, torch.device("cpu"))
    x = torch.randn(num_tokens, k, generator=generator).to(dtype)
    a = (torch.randn(num_slots, rank, k, generator=generator) / k**0.5).to(dtype)
    b = (torch.randn(num_slots, n, rank, generator=generator) / rank**0.5).to(dtype)
    weight = (torch.randn(n, k, generator=generator) / k**0.5).to(dtype)
    y = torch.zeros(num_tokens, n, dtype=dtype)

    def lora_products():
        lora.expand(y, lora.shrink(x, a, mapping), b, mapping, 0)

    return lora_products, lambda: F.linear(x, weight)


def measure(args, dtype, ops) -> list[tuple]:
    rows = []
    compiled = make_lora_kernels(dtype, ops)
    for num_tokens in args.tokens:
        for name, k, n in PROJECTIONS:
            kernel, base = lora_step(compiled, num_tokens, k, n, args.rank, args.slots, dtype)
            ref, _ = lora_step(
                reference.LORA_KERNELS, num_tokens, k, n, args.rank, args.slots, dtype
            )
            times = median_microseconds({"kernel": kernel, "ref": ref, "base": base}, args.repeats)
            rows.append((num_tokens, name, k, n, times["kernel"], times["ref"], times["base"]))
    return rows


def print_table(dtype, isa, rows) -> None:
    print(f"\n{dtype}, {isa} build, {torch.get_num_threads()} threads (medians, us per call)")
    header = (
        "T",
        "projection",
        "K",
        "N",
        "kernel",
        "reference",
        "speed-up",
        "F.linear",
        "kernel/GEMM",
    )
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for num_tokens, name, k, n, kernel, ref, base in rows:
        cells = (
            num_tokens,
            name,
            k,
            n,
            f"{kernel:.1f}",
            f"{ref:.1f}",
            f"x{ref / kernel:.1f}",
            f"{base:.1f}",
            f"{100 * kernel / base:.0f}%",
        )
        print("| " + " | ".join(str(c) for c in cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--isa", default=None, help="avx512 or avx2 (default: the best built)")
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    chosen = kernels._load(args.isa) if args.isa else kernels.load_kernels()
    if chosen.ops is None:
        raise SystemExit(f"no compiled kernels to time: {chosen.reason}")
    # The kernels' helper threads yield their cores between jobs, as in an engine whose linear
    # layers run on oneDNN (OpenMP's threads): spinning helpers would hold the second core that
    # the reference's and F.linear's OpenMP regions wait for.
    previous = chosen.ops.set_work_pool_yield(True)
    try:
        for dtype_name in args.dtype:
            dtype = getattr(torch, dtype_name)
            print_table(dtype, chosen.isa, measure(args, dtype, chosen.ops))
    finally:
        chosen.ops.set_work_pool_yield(previous)


if __name__ == "__main__":
    main()
