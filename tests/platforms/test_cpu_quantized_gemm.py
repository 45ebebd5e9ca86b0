"""The cpu platform's quantized GEMM (csrc/quantized_gemm.cpp) on both ISA builds: against the
dequantized weight times the activations rounded as the kernel rounds them (int16 per block of
32, so only the summation order differs) and times the float32 activations (what the rounding
costs), for every row count a tile can see and weights whose rows fill panels of 16 or not, and
a row's result alone equal, bit for bit, to the same row inside a batch."""

from __future__ import annotations

import pytest
import torch

from octavo.ops import reference
from octavo.testing.conformance.quantized_cases import random_rows
from octavo_cpu import kernels
from octavo_cpu.quantized_gemm import KERNEL_TYPES, pack_rows, q4_k_as_q4_1

pytest.importorskip("gguf")
ROW_COUNTS = (*range(1, 14), 31, 97, 203)
TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "int8")


def isa_ops(isa: str):
    if kernels._library_path(isa) is None or isa not in kernels.supported_isas(kernels.cpu_flags()):
        pytest.skip(f"no {isa} library built, or this CPU cannot run it")
    return kernels._load(isa).ops


def run(ops, raw: torch.Tensor, quant_type: str, x: torch.Tensor) -> torch.Tensor:
    k = x.shape[1]
    packed = pack_rows(raw.numpy(), quant_type, k)
    out = torch.empty(x.shape[0], raw.shape[0])
    ops.quantized_linear(out, x.contiguous(), packed, KERNEL_TYPES[quant_type], k)
    return out


def dequantized(raw: torch.Tensor, quant_type: str, k: int) -> torch.Tensor:
    """The weight the kernel multiplies: Q4_K's as the Q4_1 blocks it was repacked into (their
    scales rounded to float16)."""
    if quant_type == "Q4_K":
        return reference.dequantize_rows(torch.from_numpy(q4_k_as_q4_1(raw.numpy(), k)), "Q4_1", k)
    return reference.dequantize_rows(raw, quant_type, k)


def rounded_like_the_kernel(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel multiplies it: each block of 32 rounded to int16, its largest magnitude
    to 32767 (float32 arithmetic, ties to even)."""
    blocks = x.reshape(x.shape[0], -1, 32)
    largest = blocks.abs().amax(dim=2, keepdim=True)
    inverse = torch.where(largest > 0, torch.tensor(32767.0) / largest, torch.zeros_like(largest))
    values = torch.round(blocks * inverse)
    return (values * (largest / 32767.0)).reshape(x.shape)


@pytest.mark.parametrize("quant_type", TYPES)
@pytest.mark.parametrize("isa", kernels.ISAS)
def test_against_the_dequantized_weight(isa, quant_type):
    ops = isa_ops(isa)
    for k, n in ((256, 7), (512, 193), (1536, 64)):
        raw = random_rows(quant_type, n, k, seed=k)
        weight = dequantized(raw, quant_type, k)
        for m in ROW_COUNTS:
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            out, exact = run(ops, raw, quant_type, x), x @ weight.t()
            scale = exact.abs().max().item()
            expected = rounded_like_the_kernel(x) @ weight.t()
            torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5 * scale)
            assert (out - exact).abs().max() <= 1e-4 * scale


@pytest.mark.parametrize("quant_type", TYPES)
@pytest.mark.parametrize("isa", kernels.ISAS)
def test_a_row_alone_equals_the_row_in_a_batch(isa, quant_type):
    ops = isa_ops(isa)
    raw = random_rows(quant_type, 77, 512, seed=3)
    x = torch.randn(13, 512, generator=torch.Generator().manual_seed(3))
    batch = run(ops, raw, quant_type, x)
    for row in (0, 5, 12):
        assert torch.equal(run(ops, raw, quant_type, x[row : row + 1]), batch[row : row + 1])


def test_shape_errors_are_clear():
    ops = isa_ops(kernels.supported_isas(kernels.cpu_flags())[0])
    raw = random_rows("Q8_0", 8, 64, seed=0)
    packed = pack_rows(raw.numpy(), "Q8_0", 64)
    with pytest.raises(RuntimeError, match="x has 32 columns; the weight takes 64"):
        ops.quantized_linear(torch.empty(1, 8), torch.randn(1, 32), packed, 0, 64)
    with pytest.raises(RuntimeError, match="is not 8 rows of"):
        ops.quantized_linear(torch.empty(1, 8), torch.randn(1, 64), packed, 1, 64)
