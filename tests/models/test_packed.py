"""Linear layers over the platform's packed GEMM (octavo.models.layers.packed with the cpu
platform's packers: its compiled kernel and oneDNN): the same products as F.linear, the compiled
kernel's rows independent of the batch around them on every ISA built, every layer and the head
packed once, widened layers keeping their arithmetic, and the switch between the three."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from octavo.models.layers.embedding import ParallelLMHead
from octavo.models.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from octavo.models.layers.packed import PackedMatmul, pack_linears
from octavo.models.layers.widen import widen_matmuls
from octavo_cpu import gemm, kernels

needs_onednn = pytest.mark.skipif(
    gemm.onednn_packer(torch.float32) is None, reason="no oneDNN in this torch build"
)


def runnable_isas() -> list[str]:
    """The compiled libraries built here that this CPU runs."""
    return [
        isa
        for isa in kernels.supported_isas(kernels.cpu_flags())
        if kernels._library_path(isa) is not None
    ]


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 64, 300])
def test_a_onednn_product_gives_f_linear_numbers(dtype, rows):
    if gemm.onednn_packer(dtype) is None:
        pytest.skip(f"no native {dtype} GEMM here")
    torch.manual_seed(0)
    weight = (torch.randn(96, 80) / 9).to(dtype)
    x = torch.randn(rows, 80).to(dtype)
    product = gemm.onednn_packer(dtype)(weight)
    expected = F.linear(x, weight)
    if dtype == torch.bfloat16:  # torch's bfloat16 matmul is oneDNN's: the same bits
        assert torch.equal(product(x), expected)
    else:  # MKL against oneDNN: summation order only
        torch.testing.assert_close(product(x), expected, atol=1e-5, rtol=1e-5)


def compiled_case(isa: str, shape: tuple[int, int], seed: int, rows: int):
    """``(ops, weight [out, in], x [rows, in])``: the ``isa`` library's ops (skipped where it
    does not run) and a scaled random weight and rows for it."""
    if isa not in runnable_isas():
        pytest.skip(f"no {isa} library built, or this CPU cannot run it")
    out_features, in_features = shape
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=generator) / in_features**0.5
    x = torch.randn(rows, in_features, generator=generator)
    return kernels._load(isa).ops, weight, x


@pytest.mark.parametrize("isa", kernels.ISAS)
@pytest.mark.parametrize("shape", [(96, 80), (100, 7), (8200, 32), (5, 300)])
def test_the_compiled_gemm_gives_f_linear_numbers_whatever_the_batch(isa, shape):
    """Every row count through each tiling (a 1-row GEMV, the few-row tiles, whole row tiles,
    several row chunks), output widths that leave a part panel, odd inner sizes: close to
    F.linear, and each row the same bits as that row multiplied alone (batch invariance)."""
    ops, weight, x = compiled_case(isa, shape, seed=0, rows=203)
    out_features = shape[0]
    packed = ops.pack_linear_weight(weight)
    alone = torch.empty(203, out_features)
    for row in range(203):
        ops.linear(alone[row : row + 1], x[row : row + 1], packed)
    for rows in (*range(1, 14), 31, 97, 203):
        out = torch.empty(rows, out_features)
        ops.linear(out, x[:rows], packed)
        torch.testing.assert_close(out, F.linear(x[:rows], weight), atol=1e-5, rtol=1e-5)
        assert torch.equal(out, alone[:rows]), f"{rows} rows: a row depends on its batch"


@pytest.mark.parametrize("isa", kernels.ISAS)
@pytest.mark.parametrize("shape", [(100, 7), (8200, 32)])
def test_weights_kept_in_bfloat16_multiply_as_their_float32_values(isa, shape):
    """A draft head's weights packed in bfloat16 and widened in registers: every row count
    through every tile, the same bits as the float32 product over the weights rounded to
    bfloat16."""
    ops, weight, x = compiled_case(isa, shape, seed=1, rows=31)
    out_features = shape[0]
    narrow = ops.pack_linear_weight_bf16(weight)
    widened = ops.pack_linear_weight(weight.bfloat16().float())
    for rows in (*range(1, 14), 31):
        got, expected = torch.empty(rows, out_features), torch.empty(rows, out_features)
        ops.linear(got, x[:rows], narrow)
        ops.linear(expected, x[:rows], widened)
        assert torch.equal(got, expected), f"{rows} rows"


def test_the_compiled_gemm_refuses_what_does_not_fit():
    if not runnable_isas():
        pytest.skip("no compiled library built for this CPU")
    ops = kernels._load(runnable_isas()[0]).ops
    packed = ops.pack_linear_weight(torch.randn(40, 16))
    with pytest.raises(RuntimeError, match="do not match"):
        ops.linear(torch.empty(3, 40), torch.randn(3, 17), packed)
    with pytest.raises(RuntimeError, match="float32"):
        ops.linear(torch.empty(3, 40), torch.randn(3, 16, dtype=torch.bfloat16), packed)


def test_a_widened_model_packed_keeps_the_widened_numbers():
    """bfloat16 layers widened to float32 (hosts without native bfloat16), then packed by the
    compiled GEMM: bfloat16 outputs, the bias added in float32, the numbers of the widened
    layers (up to float32 summation order) and of the head."""
    dtype = torch.bfloat16
    pack = gemm.compiled_packer(dtype, widened=(dtype,))
    if pack is None:
        pytest.skip("the compiled kernels do not run here (not built, or OCTAVO_CPU_KERNELS)")
    torch.manual_seed(0)
    merged = MergedColumnParallelLinear(64, (40, 24), bias=True, dtype=dtype, device="cpu")
    head = ParallelLMHead(100, 64, dtype=dtype, device="cpu")
    for param in (merged.weight, merged.bias, head.weight):
        torch.nn.init.normal_(param, std=0.1)
    model = torch.nn.Sequential(merged, head)
    widen_matmuls(model, (dtype,))
    x = torch.randn(5, 64).to(dtype)
    widened_parts, widened_logits = merged.forward_parts(x), head(x)
    pack_linears(model, pack)
    assert isinstance(merged.quant_method, PackedMatmul) and head.packed is not None
    for part, expected in zip(merged.forward_parts(x), widened_parts):
        assert part.dtype == dtype
        torch.testing.assert_close(part, expected, atol=1e-2, rtol=1e-2)
    logits = head(x)
    assert logits.dtype == dtype
    torch.testing.assert_close(logits, widened_logits, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("choice", ["compiled", "onednn"])
def test_every_part_of_a_merged_layer_is_packed_with_its_bias(monkeypatch, choice):
    monkeypatch.setenv(gemm.GEMM_ENV, choice)
    available = {
        "compiled": gemm.compiled_packer(torch.float32),
        "onednn": gemm.onednn_packer(torch.float32),
    }
    if available[choice] is None:
        pytest.skip(f"no {choice} GEMM here")
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
    assert isinstance(merged.quant_method, PackedMatmul) and not merged.quant_method.widened
    assert isinstance(row.quant_method, PackedMatmul)
    for part, expected in zip(merged.forward_parts(x), expected_parts):
        torch.testing.assert_close(part, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(row(y), expected_row, atol=1e-5, rtol=1e-5)


def test_the_gemm_switch(monkeypatch):
    monkeypatch.setenv(gemm.GEMM_ENV, "torch")
    assert gemm.linear_packer(torch.float32) is None
    monkeypatch.setenv(gemm.GEMM_ENV, "blas")
    with pytest.raises(ValueError, match="OCTAVO_CPU_GEMM='blas': use compiled, onednn, torch"):
        gemm.linear_packer(torch.float32)
    monkeypatch.setenv(gemm.GEMM_ENV, "compiled")
    with pytest.raises(ValueError, match="OCTAVO_CPU_GEMM=compiled.*float16.*pick onednn"):
        gemm.linear_packer(torch.float16)


def test_the_default_gemm_is_the_compiled_one_where_it_runs(monkeypatch):
    monkeypatch.delenv(gemm.GEMM_ENV, raising=False)
    compiled = gemm.compiled_packer(torch.float32) is not None
    assert compiled == (kernels.load_kernels().ops is not None)
    if compiled:
        assert gemm.linear_packer(torch.float32).__qualname__.startswith("compiled_packer")
    else:
        assert gemm.linear_packer(torch.float32) in (gemm.pack_onednn, None)
    # bfloat16 computed natively is oneDNN's; widened, it is the compiled kernel's, and
    # without compiled kernels oneDNN's where this CPU has bfloat16 natively (else none)
    native = gemm.linear_packer(torch.bfloat16)
    assert native is None or native is gemm.pack_onednn
    widened = gemm.linear_packer(torch.bfloat16, widened=(torch.bfloat16,))
    if compiled:
        assert widened.__qualname__.startswith("compiled_packer")
    else:
        assert widened is gemm.onednn_packer(torch.bfloat16)


def test_without_a_packer_the_model_is_left_alone():
    layer = RowParallelLinear(4, 4, bias=False, dtype=torch.float32, device="cpu")
    pack_linears(torch.nn.Sequential(layer), None)
    assert layer.quant_method is None


def test_octavo_env_names_the_gemm(monkeypatch):
    from octavo_cpu import plugin

    monkeypatch.delenv(gemm.GEMM_ENV, raising=False)
    assert f"GEMM: {gemm.describe_gemm()}" in plugin.octavo_platform_detect().reason
    monkeypatch.setenv(gemm.GEMM_ENV, "onednn")
    assert "GEMM: onednn (OCTAVO_CPU_GEMM)" in plugin.octavo_platform_detect().reason
    monkeypatch.setenv(gemm.GEMM_ENV, "blas")
    assert "GEMM: not usable: OCTAVO_CPU_GEMM='blas'" in plugin.octavo_platform_detect().reason
