"""The cpu platform's fused Mixture-of-Experts kernel (csrc/fused_moe.cpp) beyond the conformance
suite: what the platform and a model's MoE layer get is the compiled kernel, both
instruction-set builds against the reference, experts with more rows than one work item, a
token's bits the same alone or in a batch and on any thread count, and the reference serving
what the kernel does not take."""

from __future__ import annotations

import functools
import types

import pytest
import torch

from octavo.models.layers.fused_moe import FusedExperts
from octavo.models.layers.linear import TPGroup
from octavo.ops import reference
from octavo.platform import Platform
from octavo.platform.types import MoESpec
from octavo.testing.conformance import tolerances
from octavo_cpu import kernels, plugin
from octavo_cpu.fused_moe import CompiledFusedMoE, make_fused_moe

DTYPES = (torch.float32, torch.bfloat16)
# (tokens, hidden, inner, experts, top_k): a decode, widths no vector width divides, a single
# expert, top-1, and steps whose experts get more rows than one work item (96).
SHAPES = (
    (1, 1024, 256, 64, 8),
    (5, 40, 24, 6, 3),
    (9, 33, 17, 1, 1),
    (17, 64, 48, 8, 1),
    (300, 96, 40, 4, 2),
    (130, 128, 64, 16, 8),
)


@pytest.fixture(params=kernels.ISAS)
def ops(request):
    isa = request.param
    if isa not in kernels.supported_isas(kernels.cpu_flags()) or not kernels._library_path(isa):
        pytest.skip(f"no {isa} library built, or this CPU cannot run it")
    library = kernels._load(isa).ops
    if not hasattr(library, "fused_moe"):
        pytest.skip(f"the {isa} library was built before the fused MoE: reinstall octavo-cpu")
    return library


def layer(shape, dtype, seed=0, **routing):
    """(spec, w13, w2, hidden, router_logits) of a random layer and step of ``shape``."""
    num_tokens, hidden, inner, experts, top_k = shape
    spec = MoESpec(experts, top_k, hidden, inner, dtype, **routing)
    generator = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(experts, 2 * inner, hidden, generator=generator) / hidden**0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inner, generator=generator) / inner**0.5).to(dtype)
    x = torch.randn(num_tokens, hidden, generator=generator).to(dtype)
    logits = (torch.randn(num_tokens, experts, generator=generator) * 2).to(dtype)
    return spec, w13, w2, x, logits


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "t{}h{}i{}e{}k{}".format(*s))
def test_both_builds_match_the_reference(ops, dtype, shape):
    spec, w13, w2, x, logits = layer(shape, dtype)
    out = make_fused_moe(spec, ops)(w13, w2)(x, logits)
    expected = reference.fused_moe(x, logits, w13, w2, spec)
    assert out.dtype == dtype
    tolerances.assert_close(out, expected, tolerances.FUSED_MOE[dtype], f"fused_moe {shape}")


def test_the_platform_and_a_model_layer_get_the_compiled_kernel():
    """``Platform.fused_moe`` packs for the compiled op (not the reference), and a model's MoE
    layer runs it once packed."""
    if not hasattr(kernels.load_kernels().ops, "fused_moe"):
        pytest.skip(f"no compiled fused MoE here ({kernels.load_kernels().reason})")
    platform = Platform.select("cpu")
    spec, w13, w2, x, logits = layer((3, 64, 32, 8, 2), torch.float32)
    assert isinstance(platform.fused_moe(spec)(w13, w2), CompiledFusedMoE)
    experts = FusedExperts(spec, device="cpu", tp=TPGroup())
    experts.w13_weight.data.copy_(w13)
    experts.w2_weight.data.copy_(w2)
    experts.pack(platform)
    assert isinstance(experts._fn, CompiledFusedMoE)
    expected = reference.fused_moe(x, logits, w13, w2, spec)
    tolerances.assert_close(experts(x, logits), expected, tolerances.FUSED_MOE[spec.dtype], "layer")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_token_gets_the_same_bits_alone_or_in_a_batch(ops, dtype):
    """Its experts' rows share GEMM tiles and work items with other tokens' in a batch: its
    output must not depend on them (nor on which experts the others chose)."""
    spec, w13, w2, x, logits = layer((200, 96, 40, 8, 2), dtype, seed=1)
    fn = make_fused_moe(spec, ops)(w13, w2)
    batch = fn(x, logits)
    for t in (0, 7, 99, 199):
        assert torch.equal(fn(x[t : t + 1], logits[t : t + 1]), batch[t : t + 1]), t
        assert torch.equal(fn(x[t : t + 5], logits[t : t + 5])[0], batch[t]), t


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_thread_count_does_not_change_the_bits(ops, dtype):
    """One or two threads, whole items per thread or each product split: the same bits."""
    previous = torch.get_num_threads()
    for shape in ((1, 256, 64, 16, 8), (1, 256, 64, 16, 1), (250, 128, 64, 16, 4)):
        spec, w13, w2, x, logits = layer(shape, dtype, seed=2)
        fn = make_fused_moe(spec, ops)(w13, w2)
        results = []
        try:
            for threads in (1, 2):
                torch.set_num_threads(threads)
                results.append(fn(x, logits))
        finally:
            torch.set_num_threads(previous)
        assert torch.equal(results[0], results[1]), shape


def test_grouped_routing_with_a_bias_and_strided_rows(ops):
    """DeepSeek-V3's routing (torch's, handed to the op) and hidden rows further apart than
    their width."""
    routing = dict(scoring="sigmoid", num_expert_groups=4, topk_groups=2, routed_scaling_factor=2.5)
    spec, w13, w2, x, logits = layer((23, 64, 32, 16, 4), torch.float32, seed=3, **routing)
    bias = torch.randn(16, generator=torch.Generator().manual_seed(4)) * 0.1
    wide = torch.randn(23, 100)
    wide[:, 20:84] = x
    out = make_fused_moe(spec, ops)(w13, w2)(wide[:, 20:84], logits, bias)
    expected = reference.fused_moe(x, logits, w13, w2, spec, bias)
    tolerances.assert_close(out, expected, tolerances.FUSED_MOE[torch.float32], "grouped")


def test_no_tokens_and_rows_the_kernel_does_not_take(ops):
    """An empty step gives an empty output; hidden states whose columns are not contiguous go
    to the reference."""
    spec, w13, w2, x, logits = layer((0, 32, 16, 4, 2), torch.float32)
    fn = make_fused_moe(spec, ops)(w13, w2)
    assert fn(x, logits).shape == (0, 32)
    spec, w13, w2, x, logits = layer((6, 32, 16, 4, 2), torch.float32)
    fn = make_fused_moe(spec, ops)(w13, w2)
    columns = x.t().contiguous().t()
    assert columns.stride(-1) != 1
    assert torch.equal(fn(columns, logits), reference.fused_moe(x, logits, w13, w2, spec))


def test_bad_inputs_are_refused_with_what_is_wrong(ops):
    spec, w13, w2, x, logits = layer((3, 32, 16, 4, 2), torch.float32)
    fn = make_fused_moe(spec, ops)(w13, w2)
    weights, ids = torch.full((3, 2), 0.5), torch.tensor([[0, 1], [2, 4], [3, 0]])
    with pytest.raises(RuntimeError, match="expert id 4 out of range for 4 experts"):
        ops.fused_moe(torch.empty_like(x), x, weights, ids, fn.w13_packed, fn.w2_packed)
    with pytest.raises(RuntimeError, match="do not match"):
        ops.fused_moe(torch.empty(3, 16), x[:, :16], weights, ids % 4, fn.w13_packed, fn.w2_packed)
    with pytest.raises(ValueError, match="do not match the layer"):
        make_fused_moe(spec, ops)(w13[:, :16], w2)


def test_torch_compile_traces_through_the_op(ops):
    """The op's fake lets a compiled forward keep it in its graph (no graph break)."""
    spec, w13, w2, x, logits = layer((6, 32, 16, 4, 2), torch.float32)
    fn = make_fused_moe(spec, ops)(w13, w2)
    compiled = torch.compile(fn.__call__, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x, logits), fn(x, logits), atol=0, rtol=0)


def test_no_kernel_without_the_library_or_for_other_dtypes(ops, monkeypatch):
    """None where the kernel does not run (the platform then packs the reference); the
    torch path (OCTAVO_CPU_KERNELS=torch) among them."""
    spec = MoESpec(4, 2, 32, 16, torch.float32)
    assert make_fused_moe(spec, None) is None
    assert make_fused_moe(MoESpec(4, 2, 32, 16, torch.float16), ops) is None
    assert make_fused_moe(MoESpec(4, 2, 32, 16, torch.bfloat16), ops) is not None
    cpu = types.SimpleNamespace(name=plugin.NAME)
    monkeypatch.setattr(plugin, "load_kernels", lambda: kernels._load("torch"))
    assert plugin.octavo_fused_moe(cpu, spec) is None
    packer = Platform.select("cpu").fused_moe(spec)
    assert isinstance(packer, functools.partial) and packer.func is reference.pack_fused_moe
    monkeypatch.setattr(plugin, "load_kernels", lambda: kernels.CpuKernels("x", ops, "test"))
    assert plugin.octavo_fused_moe(cpu, spec) is not None
    assert plugin.octavo_fused_moe(types.SimpleNamespace(name="cuda"), spec) is None
