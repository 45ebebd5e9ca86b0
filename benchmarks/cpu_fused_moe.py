"""Time one Mixture-of-Experts layer call on the cpu platform: the compiled fused MoE
(csrc/fused_moe.cpp, the routing in torch) against octavo.ops.reference's loop over the step's
experts.

    .venv/bin/python benchmarks/cpu_fused_moe.py [--dtype float32 bfloat16] [--isa avx2]
        [--tokens 1 4 16 256] [--hidden 1024] [--experts 64] [--top-k 8] [--inner 256]
        [--steps 16] [--threads N] [--repeats 7]

The default shape is Qwen3-30B-A3B's layer scaled to fit (there: hidden 2048, 128 experts,
top-8, expert inner width 768): hidden 1024, 64 experts, top-8, inner 256, softmax routing
renormalised. Steps of 1, 4 and 16 tokens are decodes, 256 a prefill chunk. Each call takes the
next of ``--steps`` random inputs and router logits in turn, so that calls choose other experts,
as a model's layers do (the same 8 experts each call would be read from the cache, not from
memory); a step of T tokens uses about min(64, 8 T) experts. Variants are timed
round-robin (a busy machine slows all alike); the table gives the median of ``--repeats``
rounds, each the mean over enough calls to last about 20 ms, in milliseconds per layer call.
"weights/ms" is the expert weights the step reads (its distinct experts' w13 and w2, in the
model dtype) per millisecond: decodes are bound by streaming them.

OpenMP runs as in an engine (``import octavo`` sets OMP_WAIT_POLICY=PASSIVE); the compiled
kernels run on their own work pool, whose helpers yield their cores between jobs here (as in an
engine whose other layers run on oneDNN), so the reference's OpenMP regions get both cores.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import subprocess
import time
from typing import Callable

# ruff: noqa: I001 - octavo comes before torch: it sets OMP_WAIT_POLICY before OpenMP loads
import octavo  # noqa: F401
import torch

from octavo.ops import reference
from octavo.platform.types import MoESpec
from octavo_cpu import kernels
from octavo_cpu.fused_moe import make_fused_moe


def cpu_name() -> str:
    for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
        if line.startswith("Model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def per_call(fn: Callable[[], object], seconds: float = 20e-3) -> Callable[[], float]:
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


def median_milliseconds(variants: dict[str, Callable[[], object]], repeats: int) -> dict:
    rounds = {name: per_call(fn) for name, fn in variants.items()}
    samples: dict[str, list] = {name: [] for name in variants}
    order = list(rounds.items())
    for index in range(repeats):
        for name, round_ in order if index % 2 == 0 else order[::-1]:
            samples[name].append(round_())
    return {name: statistics.median(times) * 1e3 for name, times in samples.items()}


def layer(args, dtype):
    """(spec, w13, w2) of one layer at the benchmark's shape."""
    spec = MoESpec(args.experts, args.top_k, args.hidden, args.inner, dtype)
    generator = torch.Generator().manual_seed(0)
    w13 = torch.randn(args.experts, 2 * args.inner, args.hidden, generator=generator)
    w2 = torch.randn(args.experts, args.hidden, args.inner, generator=generator)
    return spec, (w13 / args.hidden**0.5).to(dtype), (w2 / args.inner**0.5).to(dtype)


def measure(args, dtype, ops) -> list[tuple]:
    spec, w13, w2 = layer(args, dtype)
    compiled = make_fused_moe(spec, ops)(w13, w2)
    expert_bytes = (w13[0].numel() + w2[0].numel()) * w13.element_size()
    rows = []
    for num_tokens in args.tokens:
        generator = torch.Generator().manual_seed(num_tokens)
        steps = [
            (
                torch.randn(num_tokens, args.hidden, generator=generator).to(dtype),
                torch.randn(num_tokens, args.experts, generator=generator).to(dtype),
            )
            for _ in range(args.steps)
        ]
        used = statistics.mean(
            torch.unique(reference.select_experts(logits, spec)[1]).numel() for _, logits in steps
        )
        compiled_steps, reference_steps = itertools.cycle(steps), itertools.cycle(steps)
        times = median_milliseconds(
            {
                "compiled": lambda: compiled(*next(compiled_steps)),
                "reference": lambda: reference.fused_moe(*next(reference_steps), w13, w2, spec),
            },
            args.repeats,
        )
        rows.append((num_tokens, used, used * expert_bytes, times["compiled"], times["reference"]))
    return rows


def print_table(args, dtype, isa, rows) -> None:
    print(
        f"\n{dtype}, {isa} build, {torch.get_num_threads()} threads; hidden {args.hidden}, "
        f"{args.experts} experts, top-{args.top_k}, inner {args.inner} (medians, ms per call)"
    )
    header = ("T", "experts used", "compiled", "reference", "speed-up", "weights/ms")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for num_tokens, used, num_bytes, compiled, ref in rows:
        cells = (
            num_tokens,
            f"{used:.1f}",
            f"{compiled:.3f}",
            f"{ref:.3f}",
            f"x{ref / compiled:.1f}",
            f"{num_bytes / compiled / 1e6:.1f} MB",
        )
        print("| " + " | ".join(str(c) for c in cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--isa", default=None, help="avx512 or avx2 (default: the best built)")
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 4, 16, 256])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--inner", type=int, default=256)
    parser.add_argument("--steps", type=int, default=16, help="inputs cycled through per T")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    chosen = kernels._load(args.isa) if args.isa else kernels.load_kernels()
    if chosen.ops is None or not hasattr(chosen.ops, "fused_moe"):
        raise SystemExit(f"no compiled fused MoE to time ({chosen.path}: {chosen.reason})")
    print(f"CPU: {cpu_name()}; torch threads: {torch.get_num_threads()}")
    previous = chosen.ops.set_work_pool_yield(True)
    try:
        for dtype_name in args.dtype:
            dtype = getattr(torch, dtype_name)
            print_table(args, dtype, chosen.isa, measure(args, dtype, chosen.ops))
    finally:
        chosen.ops.set_work_pool_yield(previous)


if __name__ == "__main__":
    main()
