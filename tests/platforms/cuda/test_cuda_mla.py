"""The shared Triton MLA backend beyond the conformance suite (interpreter or GPU).

The suite (``octavo.testing.conformance.test_mla_attention``) checks the platform's backend
against dense attention over a few calls. Here: that the platform serves the Triton backend
(not the reference), mixed batches of prefill chunks and decodes against
``octavo.ops.reference.mla_attention`` in every dtype with tiles small enough to cross every
head, token and context tile boundary, padding tokens (neither written nor attended),
strided operands, batch invariance (a request's numbers bit-equal alone and in any batch),
the row write on its own, messages for wrong shapes, and both kernels compiled for sm_80,
sm_90 and gfx942 (run as a script, this file compiles them).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from octavo.ops import reference
from octavo.ops.reference_mla import write_mla_rows
from octavo.platform.types import MLASpec
from octavo.testing.conformance import tolerances
from octavo.testing.conformance.paged_batches import (
    allocate_block_tables,
    build_metadata,
    metadata_to,
)
from octavo_triton.mla import MLATuning, TritonMLABackend

pytestmark = pytest.mark.needs_kernels

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# GPU-like tiles: with 3 heads a program holds 4 tokens of 4 heads, 16 context rows a step.
SMALL_TILES = MLATuning(block_m=16, tile_n=16)
# (request, num_computed_tokens, num_new_tokens): a prefill's first chunk, a decode with a
# long context, a prefill's later chunk and a decode crossing a block.
MIXED = ((0, 0, 13), (1, 30, 1), (2, 9, 6), (3, 16, 1))


def mla_case(spec: MLASpec, chunks, num_padding=0, seed=0):
    """``(query, kv_row, cache, metadata)`` on the host: a cache of random rows (the context
    the chunks did not write), the call's new rows and queries, ``num_padding`` padding
    tokens (slot -1) after the real ones."""
    gen = torch.Generator().manual_seed(seed)
    final = {}
    for r, c, n in chunks:
        final[r] = max(final.get(r, 0), c + n)
    lens = [final.get(r, 1) for r in range(max(final) + 1)]
    tables, num_blocks = allocate_block_tables(lens, spec.block_size, gen)
    cache = torch.randn(num_blocks, spec.block_size, spec.row_width, generator=gen)
    metadata = build_metadata(chunks, tables, spec.block_size, num_padding)
    tokens = metadata.slot_mapping.shape[0]
    query = torch.randn(tokens, spec.num_heads, spec.row_width, generator=gen)
    kv_row = torch.randn(tokens, spec.row_width, generator=gen)
    return query.to(spec.dtype), kv_row.to(spec.dtype), cache.to(spec.dtype), metadata


def run_backend(backend, query, kv_row, cache, metadata):
    """The backend's output and cache for one call, on the host (inputs left untouched)."""
    cache = cache.clone()
    out = backend.forward(query, kv_row, cache, metadata)
    return out, cache


def spec_of(heads, latent, rope, block_size, dtype):
    return MLASpec(heads, latent, rope, dtype, block_size, scale=(latent + rope) ** -0.5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_platform_serves_the_triton_backend(platform, dtype):
    """``Platform.mla_attention_backend`` is the Triton backend in every model dtype; a
    dtype the kernels do not take falls back to the reference."""
    backend = platform.mla_attention_backend(spec_of(4, 32, 8, 16, dtype))
    assert isinstance(backend, TritonMLABackend)
    assert backend.name == f"{platform.name}-triton-mla"
    fallback = platform.mla_attention_backend(spec_of(4, 32, 8, 16, torch.float64))
    assert isinstance(fallback, reference.ReferenceMLABackend)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", ((3, 20, 6, 1), (4, 32, 8, 16)), ids=("h3l20r6b1", "h4l32r8b16"))
def test_a_mixed_batch_matches_the_reference(device, dtype, shape):
    """Prefill chunks and decodes in one call with two padding tokens: the reference within
    the suite's tolerance, the same cache bit for bit (padding never written), zeros for the
    padding tokens, the same numbers twice."""
    spec = spec_of(*shape, dtype)
    query, kv_row, cache, metadata = mla_case(spec, MIXED, num_padding=2, seed=shape[1])
    want_cache = cache.clone()
    want = reference.mla_attention(query, kv_row, want_cache, metadata, spec)
    backend = TritonMLABackend(spec, SMALL_TILES)
    on = [t.to(device) for t in (query, kv_row, cache)]
    out, got_cache = run_backend(backend, *on, metadata_to(metadata, device))
    assert out.dtype == dtype and tuple(out.shape) == (query.shape[0], spec.num_heads, shape[1])
    real = metadata.num_actual_tokens
    tolerances.assert_close(out[:real], want[:real], tolerances.ATTENTION[dtype], str(shape))
    assert torch.equal(got_cache.cpu(), want_cache)
    assert not out[real:].any()
    again, _ = run_backend(backend, *on, metadata_to(metadata, device))
    assert torch.equal(again.cpu(), out.cpu())


def test_deepseek_v3_widths(device):
    """Latent 512 and rope 64 (DeepSeek-V3's per-rank shape at two heads) in bfloat16 with
    the interpreter's tiles, decodes beside a prefill chunk."""
    spec = spec_of(2, 512, 64, 16, torch.bfloat16)
    chunks = ((0, 0, 5), (1, 20, 1), (2, 3, 1))
    query, kv_row, cache, metadata = mla_case(spec, chunks, seed=7)
    want = reference.mla_attention(query, kv_row, cache.clone(), metadata, spec)
    backend = TritonMLABackend(spec, MLATuning().for_interpreter())
    on = [t.to(device) for t in (query, kv_row, cache)]
    out, _ = run_backend(backend, *on, metadata_to(metadata, device))
    tolerances.assert_close(out, want, tolerances.ATTENTION[torch.bfloat16], "512/64")


@pytest.mark.parametrize(
    "tuning", (SMALL_TILES, MLATuning().for_interpreter()), ids=("small", "big")
)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_a_request_gets_the_same_numbers_in_any_batch(device, dtype, tuning):
    """Each request's outputs bit-equal whether it runs alone, in the mixed batch, or in the
    batch reversed: no program mixes requests and the tiles do not depend on the batch."""
    spec = spec_of(3, 20, 6, 16, dtype)
    query, kv_row, cache, metadata = mla_case(spec, MIXED, seed=11)
    backend = TritonMLABackend(spec, tuning)
    query, kv_row, cache = (t.to(device) for t in (query, kv_row, cache))
    batched, _ = run_backend(backend, query, kv_row, cache, metadata_to(metadata, device))
    starts = metadata.query_start_loc.tolist()
    order = list(range(len(MIXED)))
    for chunk_ids in [[i] for i in order] + [order[::-1]]:
        sub = build_metadata([MIXED[i] for i in chunk_ids], metadata.block_table, spec.block_size)
        pick = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in chunk_ids]).to(device)
        alone, _ = run_backend(backend, query[pick], kv_row[pick], cache, metadata_to(sub, device))
        assert torch.equal(alone.cpu(), batched[pick].cpu()), chunk_ids


def test_strided_operands(device):
    """Query and rows as column slices of wider tensors (a model's projections), and a query
    without a unit last stride: the same numbers as contiguous operands."""
    spec = spec_of(3, 20, 6, 1, torch.float32)
    query, kv_row, cache, metadata = mla_case(spec, MIXED, seed=5)
    query, kv_row, cache = (t.to(device) for t in (query, kv_row, cache))
    metadata = metadata_to(metadata, device)
    backend = TritonMLABackend(spec, SMALL_TILES)
    want, want_cache = run_backend(backend, query, kv_row, cache, metadata)
    wide_q = query.new_zeros(query.shape[0], 3, spec.row_width + 4)
    wide_q[..., 3 : 3 + spec.row_width] = query
    wide_row = kv_row.new_zeros(query.shape[0], spec.row_width + 7)
    wide_row[:, 2 : 2 + spec.row_width] = kv_row
    strided = (wide_q[..., 3 : 3 + spec.row_width], wide_row[:, 2 : 2 + spec.row_width])
    transposed = query.transpose(1, 2).contiguous().transpose(1, 2)
    assert transposed.stride(-1) != 1
    for q, row in (strided, (transposed, kv_row)):
        out, got_cache = run_backend(backend, q, row, cache, metadata)
        assert torch.equal(out, want) and torch.equal(got_cache, want_cache)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_write_rows_writes_only_the_real_tokens(device, dtype):
    """``write_rows`` (the model's expanded prefill path) stores the rows exactly, skips
    slot -1, and leaves the tokens past ``num_actual_tokens`` unwritten whatever their slot;
    a float32 row into a bfloat16 cache rounds to nearest as torch does."""
    spec = spec_of(4, 32, 8, 16, dtype)
    _, kv_row, cache, metadata = mla_case(spec, MIXED, num_padding=3, seed=3)
    real = metadata.num_actual_tokens
    unused = set(range(cache.shape[0] * spec.block_size)) - set(metadata.slot_mapping.tolist())
    metadata.slot_mapping[real] = min(unused)  # a padding token with a stale slot
    backend = TritonMLABackend(spec, SMALL_TILES)
    for rows in (kv_row, kv_row.float() * 1.001):
        got = cache.to(device)
        backend.write_rows(rows.to(device), got, metadata_to(metadata, device))
        expected = cache.clone()
        write_mla_rows(rows[:real], expected, metadata.slot_mapping[:real])
        assert torch.equal(got.cpu(), expected)


def test_wrong_shapes_say_what_to_pass(device):
    spec = spec_of(4, 32, 8, 16, torch.float16)
    query, kv_row, cache, metadata = mla_case(spec, MIXED)
    query, kv_row, cache = (t.to(device) for t in (query, kv_row, cache))
    metadata = metadata_to(metadata, device)
    backend = TritonMLABackend(spec, SMALL_TILES)
    with pytest.raises(ValueError, match=r"pass \[tokens, 4, 40\]"):
        backend.forward(query[:, :2], kv_row, cache, metadata)
    with pytest.raises(ValueError, match="allocate kv_cache_shape"):
        backend.forward(query, kv_row, cache[..., :32], metadata)
    with pytest.raises(ValueError, match="power of two >= 16"):
        TritonMLABackend(spec, MLATuning(block_m=24))
    empty = metadata_to(build_metadata([], metadata.block_table[:0].cpu(), 16), device)
    assert backend.forward(query[:0], kv_row[:0], cache, empty).shape == (0, 4, 32)


# --- compiled for real GPUs ------------------------------------------------------------------

# DeepSeek-V3 at 16 heads a rank (its wide tiles) and widths no power of two at block size 1.
COMPILE_SPECS = (("dsv3-b16", (16, 512, 64, 16)), ("odd-b1", (3, 20, 6, 1)))


def mla_builds(tuning: MLATuning):
    """The row write and the attention in each dtype for :data:`COMPILE_SPECS`."""
    from octavo_triton import compile_check as cc
    from octavo_triton import mla_kernels
    from octavo_triton.runtime import next_power_of_2

    options = {"num_warps": tuning.num_warps, "num_stages": tuning.num_stages}
    builds = []
    for dtype in cc.DTYPES:
        t = cc.TRITON_TYPES[dtype]
        for label, shape in COMPILE_SPECS:
            spec = spec_of(*shape, dtype)
            backend = TritonMLABackend(spec, tuning)
            constexprs = backend.kernel_constexprs(dtype, dtype, spec.block_size)
            pointers = {"out_ptr": t, "q_ptr": t, "cache_ptr": t, "block_table_ptr": "i32"}
            pointers.update(seq_lens_ptr="i32", query_start_loc_ptr="i32")
            write = dict(
                WIDTH=spec.row_width,
                WIDTH_PAD=next_power_of_2(spec.row_width),
                BLOCK_SIZE=spec.block_size,
                BLOCK_T=tuning.write_tokens,
                EMULATE=False,
            )
            builds += [
                cc.KernelBuild(
                    f"mla_write[{t},{label}]",
                    mla_kernels.write_rows_kernel,
                    {"row_ptr": t, "cache_ptr": t, "slot_mapping_ptr": "i64"},
                    write,
                    {},
                ),
                cc.KernelBuild(
                    f"mla_attention[{t},{label}]",
                    mla_kernels.mla_attention_kernel,
                    pointers,
                    constexprs,
                    options,
                ),
            ]
    return builds


# Each target's shared memory (LDS on gfx942) per block: a program must fit in it.
TARGETS = (("cuda", 80, 32, 166912), ("cuda", 90, 32, 232448), ("hip", "gfx942", 64, 65536))


def compile_for_targets() -> None:
    """Compile :func:`mla_builds` for :data:`TARGETS` (no GPU needed) through the shared
    ``compile_check.compile_builds``, a line per kernel: target, kernel, stages, shared bytes
    and the target's limit."""
    from triton.backends.compiler import GPUTarget

    from octavo_triton.compile_check import compile_builds

    for *target, limit in TARGETS:
        for record in compile_builds(mla_builds(MLATuning()), GPUTarget(*target)):
            stages = "+".join(record["stages"])
            print(record["target"], record["kernel"], stages, record["shared_bytes"], limit)


@pytest.mark.slow
def test_mla_kernels_compile_for_sm80_sm90_and_gfx942():
    """Dot shapes and operand types the matrix units take, and tiles within each target's
    shared memory (DeepSeek-V3's 512-wide latent tiles most of all), checked by the real
    pipeline (in a subprocess: kernels are not JITFunctions under TRITON_INTERPRET=1)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-4000:]
    lines = [line.split() for line in result.stdout.splitlines()]
    assert len(lines) == len(TARGETS) * 3 * len(COMPILE_SPECS) * 2, result.stdout
    assert all(stages in ("ptx+cubin", "amdgcn+hsaco") for _, _, stages, *_ in lines), lines
    assert all(int(shared) <= int(limit) for *_, shared, limit in lines), result.stdout


if __name__ == "__main__":
    compile_for_targets()
