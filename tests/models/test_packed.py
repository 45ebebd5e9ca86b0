"""Linear layers over the platform's packed GEMM (octavo.models.layers.packed with the cpu
platform's oneDNN packer): the same products as F.linear, every layer and the head packed once,
widened or quantised layers left alone, and the switch back to F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from octavo.models.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from octavo.models.layers.packed import PackedMatmul, pack_linears
from octavo_cpu import gemm

needs_onednn = pytest.mark.skipif(
    gemm.linear_packer(torch.float32) is None, reason="no oneDNN in this torch build"
)


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 64, 300])
def test_a_packed_product_gives_f_linear_numbers(dtype, rows):
    if gemm.linear_packer(dtype) is None:
        pytest.skip(f"no native {dtype} GEMM here")
    torch.manual_seed(0)
    weight = (torch.randn(96, 80) / 9).to(dtype)
    x = torch.randn(rows, 80).to(dtype)
    product = gemm.linear_packer(dtype)(weight)
    expected = F.linear(x, weight)
    if dtype == torch.bfloat16:  # torch's bfloat16 matmul is oneDNN's: the same bits
        assert torch.equal(product(x), expected)
    else:  # MKL against oneDNN: summation order only
        torch.testing.assert_close(product(x), expected, atol=1e-5, rtol=1e-5)


@needs_onednn
def test_every_part_of_a_merged_layer_is_packed_with_its_bias():
    torch.manual_seed(0)
    merged = MergedColumnParallelLinear(16, (8, 12), bias=True, dtype=torch.float32, device="cpu")
    row = RowParallelLinear(20, 16, bias=False, dtype=torch.float32, device="cpu")
    for layer in (merged, row):
        torch.nn.init.normal_(layer.weight)
        if layer.bias is not None:
            torch.nn.init.normal_(layer.bias)
    model = torch.nn.Sequential(merged, row)
    expected_parts = merged.forward_parts(x := torch.randn(3, 16))
    expected_row = row(y := torch.randn(3, 20))
    pack_linears(model, gemm.linear_packer(torch.float32))
    assert isinstance(merged.quant_method, PackedMatmul)
    assert isinstance(row.quant_method, PackedMatmul)
    for part, expected in zip(merged.forward_parts(x), expected_parts):
        torch.testing.assert_close(part, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(row(y), expected_row, atol=1e-5, rtol=1e-5)


def test_the_gemm_switch(monkeypatch):
    monkeypatch.setenv(gemm.GEMM_ENV, "torch")
    assert gemm.linear_packer(torch.float32) is None
    monkeypatch.setenv(gemm.GEMM_ENV, "blas")
    with pytest.raises(ValueError, match="OCTAVO_CPU_GEMM='blas': use onednn or torch"):
        gemm.linear_packer(torch.float32)


def test_without_a_packer_the_model_is_left_alone():
    layer = RowParallelLinear(4, 4, bias=False, dtype=torch.float32, device="cpu")
    pack_linears(torch.nn.Sequential(layer), None)
    assert layer.quant_method is None
