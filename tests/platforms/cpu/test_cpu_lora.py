"""The cpu platform's batched LoRA kernels (csrc/lora.cpp) beyond the conformance suite: both
instruction-set builds, widths and ranks no vector width divides, a prefill-sized segment,
strided rows, results independent of the batch and the thread count, and the reference
serving what the kernels do not take."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from octavo.lora.mapping import build_lora_mapping
from octavo.ops import reference
from octavo.testing.conformance import tolerances
from octavo_cpu import kernels, plugin
from octavo_cpu.lora import CompiledLoRAKernels, make_lora_kernels

DTYPES = (torch.float32, torch.bfloat16)
# (tokens, K, R, N, slots): decode steps of SmolLM2-135M's projections, ranks 1..64, widths no
# vector width divides, more slots than tokens.
SHAPES = (
    (1, 576, 16, 1536, 4),
    (8, 576, 16, 192, 4),
    (64, 1536, 64, 576, 8),
    (13, 33, 7, 9, 3),
    (5, 100, 1, 36, 2),
    (3, 40, 12, 70, 16),
)


@pytest.fixture(params=kernels.ISAS)
def ops(request):
    isa = request.param
    if isa not in kernels.supported_isas(kernels.cpu_flags()) or not kernels._library_path(isa):
        pytest.skip(f"no {isa} library built, or this CPU cannot run it")
    library = kernels._load(isa).ops
    if not hasattr(library, "lora_shrink"):
        pytest.skip(f"the {isa} library was built before the LoRA kernels: reinstall octavo-cpu")
    return library


def weights(num_slots, k, rank, n, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    a = torch.randn(num_slots, rank, k, generator=generator) / k**0.5
    b = torch.randn(num_slots, n, rank, generator=generator) / rank**0.5
    return a.to(dtype), b.to(dtype)


def mixed_mapping(num_tokens, num_slots, seed=0):
    slots = np.random.default_rng(seed).integers(-1, num_slots, num_tokens)
    return slots, build_lora_mapping(slots, torch.device("cpu"))


def check_shrink(lora, x, a, slots, mapping):
    out = lora.shrink(x, a, mapping)
    expected = reference.lora_shrink(x, a, mapping)
    tolerance = tolerances.LORA_SHRINK.get(x.dtype, tolerances.LORA_SHRINK[torch.float32])
    tolerances.assert_close(out, expected, tolerance, "shrink")
    base = torch.from_numpy(slots < 0)
    assert torch.equal(out[base], torch.zeros_like(out[base])), "a base-model row is not zeros"
    return out


def check_expand(lora, y, buffer, b, slots, mapping, offset):
    """Expand into ``y`` (any view) and compare with the reference; every element outside the
    adapter rows' window must keep its bits."""
    before = y.clone()
    expected = y.clone()
    reference.lora_expand(expected, buffer, b, mapping, offset)
    lora.expand(y, buffer, b, mapping, offset)
    tolerances.assert_close(y, expected, tolerances.LORA_EXPAND[y.dtype], "expand")
    untouched = torch.ones_like(y, dtype=torch.bool)
    untouched[torch.from_numpy(slots >= 0), offset : offset + b.shape[1]] = False
    assert torch.equal(y[untouched], before[untouched]), "expand wrote outside its window"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "t{}k{}r{}n{}s{}".format(*s))
def test_both_builds_match_the_reference(ops, dtype, shape):
    num_tokens, k, rank, n, num_slots = shape
    lora = make_lora_kernels(dtype, ops)
    a, b = weights(num_slots, k, rank, n, dtype)
    slots, mapping = mixed_mapping(num_tokens, num_slots)
    x = torch.randn(num_tokens, k, generator=torch.Generator().manual_seed(1)).to(dtype)
    check_shrink(lora, x, a, slots, mapping)
    fused = torch.randn(num_tokens, 3 * rank)  # the q, k, v parts of a fused shrink
    y = torch.randn(num_tokens, n + 11).to(dtype)
    check_expand(lora, y, fused[:, rank : 2 * rank], b, slots, mapping, offset=7)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_prefill_sized_segment(ops, dtype):
    """One 2048-token prompt with an adapter (split across threads by tokens and columns),
    beside a few base-model decodes."""
    a, b = weights(4, 576, 16, 1536, dtype)
    slots = np.concatenate([np.full(2048, 2), np.full(3, -1)])
    mapping = build_lora_mapping(slots, torch.device("cpu"))
    lora = make_lora_kernels(dtype, ops)
    x = torch.randn(len(slots), 576, generator=torch.Generator().manual_seed(2)).to(dtype)
    shrunk = check_shrink(lora, x, a, slots, mapping)
    check_expand(lora, torch.randn(len(slots), 1536).to(dtype), shrunk, b, slots, mapping, 0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_strided_rows_of_x_y_and_buffer(ops, dtype):
    """x, y and buffer as column windows of wider tensors: rows further apart than their width."""
    a, b = weights(3, 96, 8, 40, dtype)
    slots, mapping = mixed_mapping(21, 3, seed=3)
    lora = make_lora_kernels(dtype, ops)
    wide_x = torch.randn(21, 200).to(dtype)
    x = wide_x[:, 50:146]
    assert x.stride(0) == 200
    check_shrink(lora, x, a, slots, mapping)
    wide_y = torch.randn(21, 300).to(dtype)
    check_expand(lora, wide_y[:, 100:160], torch.randn(21, 40)[:, 16:24], b, slots, mapping, 13)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_token_gets_the_same_bits_alone_or_in_a_batch(ops, dtype):
    """Tiles of several tokens compute each token as one alone: no dependence on the batch."""
    a, b = weights(4, 576, 16, 192, dtype)
    lora = make_lora_kernels(dtype, ops)
    slots, mapping = mixed_mapping(45, 4, seed=4)
    x = torch.randn(45, 576, generator=torch.Generator().manual_seed(5)).to(dtype)
    buffer = torch.randn(45, 16, generator=torch.Generator().manual_seed(6))
    shrunk = lora.shrink(x, a, mapping)
    y = torch.zeros(45, 192, dtype=dtype)
    lora.expand(y, buffer, b, mapping, 0)
    for t in np.flatnonzero(slots >= 0)[:6]:
        alone = build_lora_mapping(slots[t : t + 1], torch.device("cpu"))
        assert torch.equal(lora.shrink(x[t : t + 1], a, alone), shrunk[t : t + 1])
        y_alone = torch.zeros(1, 192, dtype=dtype)
        lora.expand(y_alone, buffer[t : t + 1], b, alone, 0)
        assert torch.equal(y_alone, y[t : t + 1])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_thread_count_does_not_change_the_bits(ops, dtype):
    a, b = weights(4, 1536, 32, 576, dtype)
    lora = make_lora_kernels(dtype, ops)
    slots, mapping = mixed_mapping(300, 4, seed=7)
    x = torch.randn(300, 1536).to(dtype)
    previous = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            shrunk = lora.shrink(x, a, mapping)
            y = torch.zeros(300, 576, dtype=dtype)
            lora.expand(y, shrunk, b, mapping, 0)
            results.append((shrunk, y))
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_a_step_without_adapters(ops):
    lora = make_lora_kernels(torch.float32, ops)
    a, b = weights(2, 64, 8, 32, torch.float32)
    for slots in (np.zeros(0, dtype=np.int64), np.full(5, -1)):
        mapping = build_lora_mapping(slots, torch.device("cpu"))
        x = torch.randn(len(slots), 64)
        assert torch.equal(lora.shrink(x, a, mapping), torch.zeros(len(slots), 8))
        y = torch.randn(len(slots), 32)
        before = y.clone()
        lora.expand(y, torch.randn(len(slots), 8), b, mapping, 0)
        assert torch.equal(y, before)


def test_layouts_the_kernels_copy_and_dtypes_they_leave_to_the_reference(ops):
    """Columns of x, y or buffer not contiguous and weights that are views are copied on the
    way; a float64 call, or a bfloat16 model's float32 (widened) output, goes to the reference."""
    lora = make_lora_kernels(torch.float32, ops)
    a, b = weights(3, 24, 4, 10, torch.float32)
    slots, mapping = mixed_mapping(9, 3, seed=8)
    check_shrink(lora, torch.randn(24, 9).t(), a, slots, mapping)
    strided_a = a.transpose(1, 2).contiguous().transpose(1, 2)
    check_shrink(lora, torch.randn(9, 24), strided_a, slots, mapping)
    check_expand(lora, torch.randn(12, 9).t(), torch.randn(4, 9).t(), b, slots, mapping, 1)
    strided_b = b.transpose(1, 2).contiguous().transpose(1, 2)
    check_expand(lora, torch.randn(9, 10), torch.randn(9, 4), strided_b, slots, mapping, 0)
    check_shrink(lora, torch.randn(9, 24).double(), a.double(), slots, mapping)
    bf16 = make_lora_kernels(torch.bfloat16, ops)
    check_expand(bf16, torch.randn(9, 10), torch.randn(9, 4), b.bfloat16(), slots, mapping, 0)


def test_torch_compile_traces_through_the_ops(ops):
    """The ops' fakes let a compiled forward keep them in its graph (no graph break)."""
    lora = make_lora_kernels(torch.float32, ops)
    a, b = weights(2, 32, 8, 16, torch.float32)
    slots, mapping = mixed_mapping(6, 2, seed=9)
    x, y = torch.randn(6, 32), torch.randn(6, 20)

    def forward(x, y):
        out = y.clone()
        lora.expand(out, lora.shrink(x, a, mapping), b, mapping, 2)
        return out

    compiled = torch.compile(forward, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x, y), forward(x, y), atol=0, rtol=0)


def test_a_bad_mapping_is_refused_with_what_to_do(ops):
    lora = make_lora_kernels(torch.float32, ops)
    a, b = weights(2, 16, 4, 8, torch.float32)
    mapping = build_lora_mapping(np.array([0, 3, -1]), torch.device("cpu"))  # slot 3 of 2
    with pytest.raises(RuntimeError, match="reads slot 3 but the stacked weights hold 2 slots"):
        lora.shrink(torch.randn(3, 16), a, mapping)
    with pytest.raises(RuntimeError, match="reads slot 3"):
        lora.expand(torch.zeros(3, 8), torch.zeros(3, 4), b, mapping, 0)
    good = build_lora_mapping(np.array([0, 1, -1]), torch.device("cpu"))
    with pytest.raises(RuntimeError, match="offset"):
        lora.expand(torch.zeros(3, 8), torch.zeros(3, 4), b, good, 1)


def test_no_kernels_without_the_library_or_for_other_dtypes(ops, monkeypatch):
    assert make_lora_kernels(torch.float32, None) is None
    assert make_lora_kernels(torch.float16, ops) is None
    assert isinstance(make_lora_kernels(torch.bfloat16, ops), CompiledLoRAKernels)
    cpu = types.SimpleNamespace(name=plugin.NAME)
    monkeypatch.setattr(plugin, "load_kernels", lambda: kernels._load("torch"))
    assert plugin.octavo_lora_kernels(cpu, torch.float32) is None
    monkeypatch.setattr(plugin, "load_kernels", lambda: kernels.CpuKernels("x", ops, "test"))
    assert isinstance(plugin.octavo_lora_kernels(cpu, torch.float32), CompiledLoRAKernels)
    assert plugin.octavo_lora_kernels(types.SimpleNamespace(name="cuda"), torch.float32) is None
