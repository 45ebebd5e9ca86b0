"""The compiled kernels' work pool beside oneDNN's GEMMs, and the bfloat16 element-wise path.

    .venv/bin/python benchmarks/cpu_pool_beside_onednn.py [--rows 128] [--repeats 30]

1. An RMSNorm (the pool) then a ``rows x 768 x 2,048`` bfloat16 oneDNN GEMM (OpenMP's threads),
   in a loop, with the pool's helpers pausing between jobs and yielding their core
   (``set_work_pool_yield``), against each op alone; the settings alternate round by round.
2. SiLU-and-mul on ``rows x 2,048`` in bfloat16 and float32, one thread and two.

Best of ``--repeats`` rounds of 20 calls, in microseconds. Needs the compiled kernels and oneDNN.
"""

from __future__ import annotations

import argparse
import time

# ruff: noqa: I001 - octavo comes before torch: it sets OMP_WAIT_POLICY before OpenMP loads
import octavo  # noqa: F401
import torch

from octavo_cpu.kernels import load_kernels

CALLS = 20


def best_us(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(CALLS):
            fn()
        best = min(best, (time.perf_counter() - start) / CALLS)
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    ops = load_kernels().ops
    if ops is None or not torch.backends.mkldnn.is_available():
        raise SystemExit("needs the compiled cpu kernels and oneDNN")
    torch.set_num_threads(2)
    x = torch.randn(args.rows, 768).bfloat16()
    norm_weight = torch.ones(768).bfloat16()
    packed = torch.ops.mkldnn._reorder_linear_weight(torch.randn(2048, 768).bfloat16(), 64)
    normed = torch.empty_like(x)

    def norm():
        ops.rms_norm(normed, x, norm_weight, 1e-5)

    def gemm():
        torch.ops.mkldnn._linear_pointwise(normed, packed, None, "none", [], "")

    def pair():
        norm()
        gemm()

    previous = ops.set_work_pool_yield(False)
    try:
        for round_ in range(3):
            for setting, yields in (("pause", False), ("yield", True)):
                ops.set_work_pool_yield(yields)
                times = {
                    name: best_us(fn, args.repeats)
                    for name, fn in (("norm + GEMM", pair), ("GEMM", gemm), ("norm", norm))
                }
                extra = times["norm + GEMM"] - times["GEMM"] - times["norm"]
                print(
                    f"round {round_} helpers {setting}: "
                    + ", ".join(f"{k} {v:7.1f} us" for k, v in times.items())
                    + f"; together minus apart {extra:6.1f} us",
                    flush=True,
                )
    finally:
        ops.set_work_pool_yield(previous)
    for dtype in (torch.bfloat16, torch.float32):
        gate, up = torch.randn(2, args.rows, 2048).to(dtype)
        out = torch.empty_like(gate)
        for threads in (1, 2):
            torch.set_num_threads(threads)
            us = best_us(lambda: ops.silu_and_mul(out, gate, up), args.repeats)
            print(
                f"silu_and_mul {dtype} {args.rows} x 2048, {threads} thread(s): {us:8.1f} us, "
                f"{args.rows * 2048 / us / 1e3:.2f} Gelem/s",
                flush=True,
            )


if __name__ == "__main__":
    main()
