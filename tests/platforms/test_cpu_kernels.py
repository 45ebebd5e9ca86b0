"""The cpu platform's compiled kernels: which library loads, forcing one, and the torch path
they fall back to (the conformance suite checks the kernels themselves, on every path CI runs)."""

from __future__ import annotations

import pytest
import torch

from octavo.platform.types import AttentionSpec
from octavo_cpu import kernels
from octavo_cpu.attention import CpuAttentionBackend

AVX512_HOST = frozenset(
    "avx512f avx512bw avx512vl avx512dq avx512_bf16 avx512_vnni fma avx2 f16c".split()
)
AVX2_HOST = frozenset("avx2 fma f16c sse4_2".split())


def built(isa: str) -> bool:
    return kernels._library_path(isa) is not None


def test_supported_isas_follow_the_cpu_flags():
    assert kernels.supported_isas(AVX512_HOST) == ["avx512", "avx2"]
    assert kernels.supported_isas(AVX2_HOST) == ["avx2"]
    assert kernels.supported_isas(AVX512_HOST - {"avx512_bf16"}) == ["avx2"]
    assert kernels.supported_isas(frozenset({"sse4_2"})) == []


def test_torch_forced_loads_nothing():
    chosen = kernels._load("torch")
    assert chosen.ops is None and chosen.path == "torch" and "OCTAVO_CPU_KERNELS" in chosen.reason


def test_an_unknown_choice_is_refused():
    with pytest.raises(ValueError, match="OCTAVO_CPU_KERNELS='sse'.*avx512, avx2, torch"):
        kernels._load("sse")


@pytest.mark.parametrize("isa", kernels.ISAS)
def test_a_forced_isa_loads_its_library_or_is_refused(isa):
    runnable = kernels.supported_isas(kernels.cpu_flags())
    if isa not in runnable:
        with pytest.raises(ValueError, match=f"lacks {isa}"):
            kernels._load(isa)
        return
    chosen = kernels._load(isa)
    if built(isa):
        assert chosen.isa == isa and chosen.path == f"compiled ({isa})"
        assert hasattr(chosen.ops, "paged_attention")
    else:
        assert chosen.ops is None and "no compiled library" in chosen.reason


def test_the_default_is_the_best_built_library_this_cpu_runs():
    runnable = [isa for isa in kernels.supported_isas(kernels.cpu_flags()) if built(isa)]
    chosen = kernels._load("")
    assert chosen.isa == (runnable[0] if runnable else None)


@pytest.mark.parametrize("isa", kernels.ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_and_torch_paths_agree_on_a_mixed_batch(isa, dtype):
    """Both paths on one mixed batch (a prefill chunk after context beside decodes), block
    size 1 and head_dim 8 as stories260K has; the conformance suite holds each to the reference."""
    from octavo.testing.conformance.paged_batches import allocate_block_tables, build_metadata

    if not built(isa) or isa not in kernels.supported_isas(kernels.cpu_flags()):
        pytest.skip(f"no {isa} library built, or this CPU cannot run it")

    spec = AttentionSpec(
        num_heads=8, num_kv_heads=4, head_dim=8, dtype=dtype, block_size=1, scale=8**-0.5
    )
    generator = torch.Generator().manual_seed(0)
    tables, num_blocks = allocate_block_tables([40, 30, 9], 1, generator)
    chunks = [(0, 30, 10), (1, 29, 1), (2, 8, 1)]
    metadata = build_metadata(chunks, tables, 1)
    num_tokens = 12
    q = torch.randn(num_tokens, 8, 8, generator=generator).to(dtype)
    k = torch.randn(num_tokens, 4, 8, generator=generator).to(dtype)
    v = torch.randn(num_tokens, 4, 8, generator=generator).to(dtype)
    compiled = CpuAttentionBackend(spec, kernels._load(isa))
    torch_path = CpuAttentionBackend(spec, kernels._load("torch"))
    cache = torch.randn(compiled.kv_cache_shape(num_blocks), generator=generator).to(dtype)
    expected = torch_path.forward(q, k, v, cache.clone(), metadata)
    actual = compiled.forward(q, k, v, cache.clone(), metadata)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(actual.float(), expected.float(), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("isa", kernels.ISAS)
@pytest.mark.parametrize("window", [None, 700])
def test_split_kv_decodes_merge_to_the_torch_result(isa, window):
    """One KV head and two requests cannot keep the threads busy: the kernel splits their long
    contexts into ranges and merges them (the conformance suite's short contexts never split)."""
    from octavo.testing.conformance.paged_batches import allocate_block_tables, build_metadata

    if not built(isa) or isa not in kernels.supported_isas(kernels.cpu_flags()):
        pytest.skip(f"no {isa} library built, or this CPU cannot run it")
    spec = AttentionSpec(
        num_heads=4,
        num_kv_heads=1,
        head_dim=32,
        dtype=torch.float32,
        block_size=16,
        scale=32**-0.5,
        sliding_window=window,
    )
    generator = torch.Generator().manual_seed(1)
    tables, num_blocks = allocate_block_tables([1500, 1100], 16, generator)
    metadata = build_metadata([(0, 1499, 1), (1, 1095, 5)], tables, 16)
    q = torch.randn(6, 4, 32, generator=generator)
    k = torch.randn(6, 1, 32, generator=generator)
    v = torch.randn(6, 1, 32, generator=generator)
    compiled = CpuAttentionBackend(spec, kernels._load(isa))
    torch_path = CpuAttentionBackend(spec, kernels._load("torch"))
    cache = torch.randn(compiled.kv_cache_shape(num_blocks), generator=generator)
    previous = torch.get_num_threads()
    torch.set_num_threads(2)  # the split depends on the thread count; two threads split here
    try:
        actual = compiled.forward(q, k, v, cache.clone(), metadata)
    finally:
        torch.set_num_threads(previous)
    expected = torch_path.forward(q, k, v, cache.clone(), metadata)
    torch.testing.assert_close(actual, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("isa", kernels.ISAS)
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_items_of_all_kv_heads_match_the_torch_result(isa, block_size, dtype):
    """24 decodes of 100-299 tokens and a 12-token chunk on two threads: work enough for every
    thread and no item too large to share out (the largest, the chunk's 12 x 62, is under a
    quarter of the ~5,500 in all), so an item takes all of a request's KV heads (a small
    batch's items take one each, above)."""
    from octavo.testing.conformance.paged_batches import allocate_block_tables, build_metadata

    if not built(isa) or isa not in kernels.supported_isas(kernels.cpu_flags()):
        pytest.skip(f"no {isa} library built, or this CPU cannot run it")
    spec = AttentionSpec(
        num_heads=8, num_kv_heads=4, head_dim=32, dtype=dtype, block_size=block_size, scale=0.2
    )
    generator = torch.Generator().manual_seed(2)
    lengths = [int(n) for n in torch.randint(100, 300, (24,), generator=generator)]
    tables, num_blocks = allocate_block_tables([*lengths, 62], block_size, generator)
    chunks = [(r, n - 1, 1) for r, n in enumerate(lengths)] + [(24, 50, 12)]
    metadata = build_metadata(chunks, tables, block_size)
    q = torch.randn(36, 8, 32, generator=generator).to(dtype)
    k = torch.randn(36, 4, 32, generator=generator).to(dtype)
    v = torch.randn(36, 4, 32, generator=generator).to(dtype)
    compiled = CpuAttentionBackend(spec, kernels._load(isa))
    torch_path = CpuAttentionBackend(spec, kernels._load("torch"))
    cache = torch.randn(compiled.kv_cache_shape(num_blocks), generator=generator).to(dtype)
    previous = torch.get_num_threads()
    torch.set_num_threads(2)  # the item shape depends on the thread count
    try:
        actual = compiled.forward(q, k, v, cache.clone(), metadata)
    finally:
        torch.set_num_threads(previous)
    expected = torch_path.forward(q, k, v, cache.clone(), metadata)
    tolerance = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(actual.float(), expected.float(), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("isa", kernels.ISAS)
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decodes_sharing_a_prefix_give_the_bits_of_unshared_copies(isa, block_size, dtype):
    """Decodes whose block tables begin with the same blocks attend them together (cascade
    attention), the rest apart; the same decodes over private copies of those blocks attend
    each alone. The outputs are the same bits, and the torch path's within tolerance."""
    from octavo.testing.conformance.paged_batches import build_metadata

    if not built(isa) or isa not in kernels.supported_isas(kernels.cpu_flags()):
        pytest.skip(f"no {isa} library built, or this CPU cannot run it")
    spec = AttentionSpec(
        num_heads=8, num_kv_heads=4, head_dim=32, dtype=dtype, block_size=block_size, scale=0.2
    )
    generator = torch.Generator().manual_seed(3)
    prefix_blocks = 160 // block_size  # 160 tokens: 2.5 groups of 64, so the cut falls inside
    lengths = [int(n) for n in torch.randint(170, 260, (9,), generator=generator)]
    own = [-(-n // block_size) - prefix_blocks for n in lengths]
    num_blocks = prefix_blocks * (1 + len(lengths)) + sum(own) + 1
    pool = torch.randperm(num_blocks, generator=generator).to(torch.int32)
    shared = pool[:prefix_blocks]
    width = max(prefix_blocks + n for n in own)
    tables = torch.zeros(2, len(lengths), width, dtype=torch.int32)
    at = prefix_blocks
    for r, n in enumerate(own):
        copies = pool[at : at + prefix_blocks]
        mine = pool[at + prefix_blocks : at + prefix_blocks + n]
        at += prefix_blocks + n
        tables[0, r, : prefix_blocks + n] = torch.cat([shared, mine])
        tables[1, r, : prefix_blocks + n] = torch.cat([copies, mine])
    compiled = CpuAttentionBackend(spec, kernels._load(isa))
    cache = torch.randn(compiled.kv_cache_shape(num_blocks), generator=generator).to(dtype)
    for r in range(len(lengths)):  # the private copies hold the shared blocks' values
        cache[:, tables[1, r, :prefix_blocks].long()] = cache[:, shared.long()]
    chunks = [(r, n - 1, 1) for r, n in enumerate(lengths)]
    q = torch.randn(len(lengths), 8, 32, generator=generator).to(dtype)
    k = torch.randn(len(lengths), 4, 32, generator=generator).to(dtype)
    v = torch.randn(len(lengths), 4, 32, generator=generator).to(dtype)
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        cascaded, apart = (
            compiled.forward(q, k, v, cache.clone(), build_metadata(chunks, t, block_size))
            for t in tables
        )
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(cascaded, apart)
    torch_path = CpuAttentionBackend(spec, kernels._load("torch"))
    expected = torch_path.forward(
        q, k, v, cache.clone(), build_metadata(chunks, tables[0], block_size)
    )
    tolerance = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(cascaded.float(), expected.float(), atol=tolerance, rtol=tolerance)


def _op_samples(ops):
    """One small, valid call of each compiled op: ``{name: (op, args)}``."""
    generator = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=generator)

    num_blocks, kv_heads, block_size, head_dim = 4, 2, 16, 8
    kv_cache = randn(2, num_blocks, kv_heads, block_size, head_dim)
    q, k, v = randn(3, 4, head_dim), randn(3, kv_heads, head_dim), randn(3, kv_heads, head_dim)
    attention = (
        torch.empty(3, 4, head_dim),
        q,
        k,
        v,
        kv_cache,
        torch.tensor([0, 1, 17]),
        torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
        torch.tensor([0, 2, 3], dtype=torch.int32),
        torch.tensor([2, 18], dtype=torch.int32),
        head_dim**-0.5,
        -1,
        3,
    )
    x, residual, weight = randn(3, 32), randn(3, 32), randn(32)
    qkv = randn(3, 6 * head_dim)
    cos, sin = randn(3, head_dim), randn(3, head_dim)
    return {
        "paged_attention": (ops.paged_attention, attention),
        "rms_norm": (ops.rms_norm, (torch.empty(3, 32), x, weight, 1e-5)),
        "fused_add_rms_norm": (
            ops.fused_add_rms_norm,
            (torch.empty(3, 32), torch.empty(3, 32), x, residual, weight, 1e-5),
        ),
        "silu_and_mul": (ops.silu_and_mul, (torch.empty(3, 16), x[:, :16], x[:, 16:])),
        "argmax_rows": (ops.argmax_rows, (torch.empty(3, dtype=torch.long), x)),
        "rotary_embedding": (
            ops.rotary_embedding,
            (qkv[:, : 4 * head_dim], qkv[:, 4 * head_dim :], cos, sin, head_dim),
        ),
    }


@pytest.mark.parametrize("isa", kernels.ISAS)
def test_every_compiled_op_has_a_fake_that_matches_it(isa):
    """What torch.compile needs to trace through the ops (their schemas' mutations and a fake
    implementation agreeing with the real one), checked by torch.library.opcheck."""
    if isa not in kernels.supported_isas(kernels.cpu_flags()) or not built(isa):
        pytest.skip(f"no {isa} library runs here")
    ops = kernels._load(isa).ops
    for name, (op, args) in _op_samples(ops).items():
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))


def _argmax_cases(dtype: torch.dtype) -> list[torch.Tensor]:
    """Rows of many lengths around the vector width, with ties in one lane and across lanes,
    all -inf, +inf, NaN, and a maximum in the tail after the last whole vector."""
    generator = torch.Generator().manual_seed(5)
    cases = [torch.randn(4, n, generator=generator) for n in (1, 3, 7, 8, 9, 16, 17, 257, 8192)]
    ties = torch.randn(6, 40, generator=generator)
    ties[0, [5, 13, 21]] = 9.0  # one lane (width 8 or 16)
    ties[1, [3, 4, 36]] = 9.0  # neighbouring lanes, and a tail element
    ties[2] = float("-inf")
    ties[3, [2, 30]] = float("inf")
    ties[4, [7, 33]] = float("nan")  # the first NaN wins, as torch's argmax has it
    ties[5, 39] = 9.0  # the maximum in the tail
    cases.append(ties)
    return [case.to(dtype) for case in cases]


@pytest.mark.parametrize("isa", kernels.ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_argmax_rows_is_torch_argmax(isa, dtype):
    """Greedy sampling's compiled argmax: torch's index on every row (first on ties)."""
    if isa not in kernels.supported_isas(kernels.cpu_flags()) or not built(isa):
        pytest.skip(f"no {isa} library runs here")
    ops = kernels._load(isa).ops
    for logits in _argmax_cases(dtype):
        out = torch.full((logits.shape[0],), -1, dtype=torch.long)
        ops.argmax_rows(out, logits)
        assert out.tolist() == logits.argmax(dim=-1).tolist(), (dtype, logits.shape)


@pytest.mark.parametrize("isa", kernels.ISAS)
def test_bfloat16_sums_round_as_torch_rounds(isa):
    """The element-wise kernels round bfloat16 in float's bits (csrc/widen.h): the residual sum
    of fused_add_rms_norm is torch's bfloat16 add, bit for bit, over every bfloat16 value
    (ties, infinities, subnormals; NaN stays NaN), in vector lanes and in a row's tail."""
    if isa not in kernels.supported_isas(kernels.cpu_flags()) or not built(isa):
        pytest.skip(f"no {isa} library runs here")
    ops = kernels._load(isa).ops
    n = 40  # whole vectors and a tail on either ISA
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    rows = -(-every.numel() // n)
    x = torch.cat([every, every[: rows * n - every.numel()]]).view(rows, n)
    generator = torch.Generator().manual_seed(0)
    residual = (torch.randn(rows, n, generator=generator) * 4).to(torch.bfloat16)
    residual[::3] = x[::3].flip(1)  # sums of two bfloat16 values that tie half-way
    out, summed = torch.empty_like(x), torch.empty_like(x)
    ops.fused_add_rms_norm(out, summed, x, residual, torch.ones(n, dtype=torch.bfloat16), 1e-6)
    expected = (x.float() + residual.float()).to(torch.bfloat16)
    nan = expected.isnan()
    assert torch.equal(summed.isnan(), nan)
    assert torch.equal(summed[~nan].view(torch.int16), expected[~nan].view(torch.int16))
