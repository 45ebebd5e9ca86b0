"""Time the cpu platform's weight-only quantized GEMMs on one pass over a model's linear layers
(every layer its own weights, streamed as a decode step streams them), against the float32
compiled GEMM and oneDNN's bfloat16 GEMM on the same shapes, and a memory copy measured in the
same run: the bandwidth the weights' bytes could stream at.

    .venv/bin/python benchmarks/cpu_quantized_gemm.py [--tokens 1 2 4 8 64] [--repeats 9]
        [--threads N] [--shape smollm2-135m|llama-7b-layer]

Shapes: ``smollm2-135m`` is SmolLM2-135M's 30 layers (q/k/v fused 576->960, o 576->576,
gate and up 576->1536 each, down 1536->576; 425 MB of float32 weights); ``llama-7b-layer`` four
layers of a 7B Llama (4096->12288, 4096->4096, 4096->11008 x2, 11008->4096). GB/s is the
weight bytes of each format over the pass's median time (the activations are ~0.1% of them).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time

# ruff: noqa: I001 - octavo comes before torch: it sets OMP_WAIT_POLICY before OpenMP loads
import octavo  # noqa: F401
import torch

from octavo.quantization.quantized_linear import int8_rows
from octavo.testing.conformance.quantized_cases import random_rows
from octavo_cpu.gemm import compiled_packer, pack_onednn
from octavo_cpu.quantized_gemm import quantized_packer

SHAPES = {
    "smollm2-135m": [(576, 960), (576, 576), (576, 1536), (576, 1536), (1536, 576)] * 30,
    "llama-7b-layer": [(4096, 12288), (4096, 4096), (4096, 11008), (4096, 11008), (11008, 4096)]
    * 4,
}
TYPES = ("Q8_0", "int8", "Q4_0", "Q4_1", "Q4_K")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 64])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--shape", choices=SHAPES, default="smollm2-135m")
    return parser.parse_args(argv)


def copy_bandwidth(repeats: int) -> float:
    """GB/s of a 256 MiB copy (read + write counted), the median of ``repeats``."""
    src = torch.ones(64 * 2**20)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return 2 * src.numel() * 4 / statistics.median(times) / 1e9


def layer_products(kind: str, shapes) -> tuple[list, int]:
    """``(products, weight bytes)`` of one pass over ``shapes`` in ``kind``'s format."""
    products, total = [], 0
    for index, (k, n) in enumerate(shapes):
        if kind in ("float32", "bfloat16"):
            weight = torch.randn(n, k, generator=torch.Generator().manual_seed(index))
            if kind == "float32":
                products.append(compiled_packer(torch.float32)(weight))
            else:
                products.append(pack_onednn(weight.to(torch.bfloat16)))
            total += weight.numel() * (4 if kind == "float32" else 2)
            continue
        raw = (
            int8_rows(torch.randn(n, k)) if kind == "int8" else random_rows(kind, n, k, seed=index)
        )
        products.append(quantized_packer(kind)(raw, k))
        total += raw.numel()
    return products, total


def time_pass(products, shapes, tokens: int, dtype, repeats: int) -> float:
    inputs = {k: torch.randn(tokens, k).to(dtype) for k, _ in shapes}
    for product, (k, _) in zip(products, shapes):
        product(inputs[k])  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for product, (k, _) in zip(products, shapes):
            product(inputs[k])
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def cpu_name() -> str:
    for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
        if line.startswith("Model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = SHAPES[args.shape]
    print(f"CPU: {cpu_name()}; torch threads: {torch.get_num_threads()}; shape: {args.shape}")
    print(f"copy bandwidth: {copy_bandwidth(args.repeats):.1f} GB/s (read + write)")
    print(f"{'format':>9} {'MB':>7} " + " ".join(f"{'M=' + str(t):>17}" for t in args.tokens))
    for kind in ("float32", "bfloat16", *TYPES):
        if kind == "Q4_K" and any(k % 256 for k, _ in shapes):
            print(f"{kind:>9} (its super-blocks of 256 do not divide these rows)")
            continue
        products, total = layer_products(kind, shapes)
        dtype = torch.bfloat16 if kind == "bfloat16" else torch.float32
        cells = []
        for tokens in args.tokens:
            seconds = time_pass(products, shapes, tokens, dtype, args.repeats)
            cells.append(f"{seconds * 1e3:8.2f}ms {total / seconds / 1e9:5.1f}GB/s")
        print(f"{kind:>9} {total / 1e6:7.1f} " + " ".join(cells))
        del products


if __name__ == "__main__":
    main()
