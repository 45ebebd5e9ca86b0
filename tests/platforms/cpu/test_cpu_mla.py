"""The cpu platform's latent-attention kernel (csrc/mla_attention.cpp) beyond the conformance
suite: what the platform gives is the compiled backend, both instruction-set builds against the
reference on mixed batches with padding rows, rows written bit-equal to the reference's, a
request's bits the same alone or in a batch, and the reference serving what it does not take."""

from __future__ import annotations

import pytest
import torch

from octavo.ops import reference
from octavo.platform import Platform
from octavo.platform.types import MLASpec
from octavo.testing.conformance import tolerances
from octavo.testing.conformance.paged_batches import allocate_block_tables, build_metadata
from octavo_cpu import kernels
from octavo_cpu.mla import CpuMLABackend, make_mla_backend

DTYPES = (torch.float32, torch.bfloat16)
# (heads, kv_lora_rank, qk_rope_head_dim, block_size): widths no vector width divides, block
# size 1, DeepSeek-V3's widths at 16 heads, more heads than one pass of the score loop.
SHAPES = ((4, 32, 8, 16), (3, 20, 6, 1), (16, 512, 64, 16), (20, 40, 8, 8))
# Calls in order: (request, num_computed_tokens, num_new_tokens) chunks.
CALLS = (((0, 0, 11), (1, 0, 5)), ((0, 11, 9), (1, 5, 1)), ((1, 6, 1), (2, 0, 7), (0, 20, 1)))
PADDING = 2


@pytest.fixture(params=kernels.ISAS)
def ops(request):
    isa = request.param
    if isa not in kernels.supported_isas(kernels.cpu_flags()) or not kernels._library_path(isa):
        pytest.skip(f"no {isa} library built, or this CPU cannot run it")
    library = kernels._load(isa).ops
    if not hasattr(library, "mla_attention"):
        pytest.skip(f"the {isa} library was built before the MLA kernel: reinstall octavo-cpu")
    return library


def step(call, tables, block_size, heads, width, dtype, generator):
    """(metadata with PADDING padding tokens, queries, rows) of one call."""
    metadata = build_metadata(call, tables, block_size)
    num_tokens = sum(n for *_, n in call)
    metadata.slot_mapping = torch.cat([metadata.slot_mapping, torch.full((PADDING,), -1)])
    metadata.num_actual_tokens = num_tokens
    total = num_tokens + PADDING
    query = torch.randn(total, heads, width, generator=generator).to(dtype)
    rows = torch.randn(total, width, generator=generator).to(dtype)
    return metadata, query, rows


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "h{}l{}r{}b{}".format(*s))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_compiled_mla_matches_the_reference_and_is_batch_invariant(ops, dtype, shape):
    heads, latent, rope, block_size = shape
    spec = MLASpec(heads, latent, rope, dtype, block_size, (latent + rope) ** -0.5)
    backend = CpuMLABackend(spec, ops)
    generator = torch.Generator().manual_seed(heads + latent)
    tables, num_blocks = allocate_block_tables([21, 7, 7], block_size, generator)
    cache = torch.randn(backend.kv_cache_shape(num_blocks), generator=generator).to(dtype)
    cache_ref = cache.clone()
    for call in CALLS:
        metadata, query, rows = step(
            call, tables, block_size, heads, latent + rope, dtype, generator
        )
        want = reference.mla_attention(query, rows, cache_ref, metadata, spec)
        out = backend.forward(query, rows, cache, metadata)
        assert torch.equal(cache, cache_ref), "rows are written as the reference writes them"
        assert (out[-PADDING:] == 0).all(), "padding rows are zero"
        tolerances.assert_close(out, want, tolerances.ATTENTION[dtype], f"{shape} {call}")
        starts = metadata.query_start_loc.tolist()
        for i, (r, c, n) in enumerate(call):  # each request alone: the same bits
            alone = build_metadata(((r, c, n),), tables, block_size)
            part = slice(starts[i], starts[i + 1])
            got = backend.forward(query[part], rows[part], cache, alone)
            assert torch.equal(got, out[part]), f"request {r} alone differs in {call}"


def test_the_platform_serves_the_compiled_backend_where_it_can(ops):
    platform = Platform.select("cpu")
    if kernels.load_kernels().ops is None or not hasattr(
        kernels.load_kernels().ops, "mla_attention"
    ):
        pytest.skip("the selected library has no MLA kernel")
    spec = MLASpec(4, 32, 8, torch.bfloat16, 16, 0.1)
    assert isinstance(platform.mla_attention_backend(spec), CpuMLABackend)
    float64 = MLASpec(4, 32, 8, torch.float64, 16, 0.1)
    assert make_mla_backend(float64, ops) is None
    assert platform.mla_attention_backend(float64).name == "reference-mla"
    assert make_mla_backend(spec, None) is None  # no compiled library: the reference serves
