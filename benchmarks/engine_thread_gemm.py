"""A linear layer's cost on the main thread against a thread of its own, as the server's engine
runs (its steps run in the ``octavo-engine`` thread while the event loop holds the main one).

    .venv/bin/python benchmarks/engine_thread_gemm.py [--rows 1] [--in 256] [--out 1536]

For one and two torch threads it times oneDNN over a weight packed at load (the cpu platform's
GEMM) and ``F.linear`` (MKL), in microseconds per call, first on the main thread, then on a new
thread. On the 2-core AVX-512 host of BENCHMARKS.md (1 x 256 x 1536): on one thread ~52 us
everywhere; on two, 145-177 us with octavo's OMP_WAIT_POLICY=PASSIVE on either thread, and with
OMP_WAIT_POLICY=ACTIVE (spinning workers) 39 us on the main thread but 144 us on the new one.
MKL's ``F.linear`` showed neither difference.
"""

from __future__ import annotations

import argparse
import threading
import time

# ruff: noqa: I001 - octavo comes before torch: it sets OMP_WAIT_POLICY before OpenMP loads
import octavo  # noqa: F401
import torch
import torch.nn.functional as F
from octavo_cpu.gemm import pack_onednn


def time_call(fn, calls: int = 2000) -> float:
    for _ in range(200):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def measure(where: str, threads: int, x: torch.Tensor, weight: torch.Tensor, packed) -> None:
    torch.set_num_threads(threads)
    onednn = time_call(lambda: packed(x))
    mkl = time_call(lambda: F.linear(x, weight))
    print(f"{where:<12} {threads} thread(s): oneDNN packed {onednn:7.1f} us, F.linear {mkl:7.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--in", dest="in_features", type=int, default=256)
    parser.add_argument("--out", dest="out_features", type=int, default=1536)
    args = parser.parse_args()
    weight = torch.randn(args.out_features, args.in_features)
    packed = pack_onednn(weight)
    x = torch.randn(args.rows, args.in_features)
    for threads in (1, 2):
        measure("main thread", threads, x, weight, packed)
        other = threading.Thread(target=measure, args=("new thread", threads, x, weight, packed))
        other.start()
        other.join()


if __name__ == "__main__":
    main()
