"""The cuda platform's Triton kernels against octavo.ops.reference (interpreter or GPU)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from octavo.platform.types import AttentionSpec
from octavo_cuda import tuning
from octavo_triton.attention import TritonAttentionBackend
from octavo_triton import kernel_checks as checks
from octavo_triton.sampler import make_sampler
from octavo_triton.fp8 import make_scaled_mm
from octavo_triton.tuning import MatmulTuning, SamplerTuning

pytestmark = pytest.mark.needs_kernels

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", checks.ATTENTION_CASES, ids=lambda c: c.name)
def test_paged_attention_matches_reference(platform, device, dtype, case):
    checks.check_attention(platform.attention_backend, device, dtype, case)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", checks.SPLIT_KV_CASES, ids=lambda c: c.name)
def test_split_kv_with_the_gpu_tiles(device, dtype, case):
    """The cuda tiles (16-row query blocks, 64-token context tiles) and split-KV over 3-5
    segments of one tile, each merged by the second kernel."""
    gpu = tuning.attention_tuning(AttentionSpec(8, 2, 32, dtype, 16, 1.0))
    forced = dataclasses.replace(
        gpu,
        split_kv_segment_len=64,
        split_kv_max_programs=1 << 30,
        interpreter_block_m=gpu.block_m,
        interpreter_tile_n=gpu.tile_n,
        interpreter_kv_write_tokens=gpu.kv_write_tokens,
        interpreter_split_kv_segment_len=32,
    )
    backend_for = lambda spec: TritonAttentionBackend(spec, forced)  # noqa: E731
    spec = AttentionSpec(
        case.num_heads, case.num_kv_heads, case.head_dim, dtype, case.block_size, 1.0
    )
    batch = checks.random_paged_batch(
        case.query_lens,
        case.context_lens,
        case.num_heads,
        case.num_kv_heads,
        case.head_dim,
        case.block_size,
        dtype,
    )
    assert backend_for(spec).num_segments(batch.metadata, batch.query.shape[0]) >= 3
    checks.check_attention(backend_for, device, dtype, case)


@pytest.mark.parametrize("dtype", [torch.float16], ids=str)
def test_paged_attention_accepts_fused_qkv_slices(platform, device, dtype):
    checks.check_attention_strided_query(platform, device, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [48, 200])
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "fused-add"])
def test_rms_norm_matches_reference(platform, device, dtype, hidden, with_residual):
    checks.check_rms_norm(platform, device, dtype, hidden, with_residual)


@pytest.mark.parametrize("case", checks.SAMPLING_CASES, ids=lambda c: c.name)
def test_sampler_draws_the_reference_tokens(platform, device, case):
    checks.check_sampler(platform, device, case)


def test_greedy_sampling_is_argmax_lowest_index(platform, device):
    checks.check_greedy(platform, device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("vocab_size", [64, 100])
@pytest.mark.parametrize("use_indices", [False, True], ids=["rows", "indices"])
def test_token_bitmask_matches_reference(platform, device, dtype, vocab_size, use_indices):
    checks.check_bitmask(platform, device, dtype, vocab_size, use_indices)


@pytest.mark.parametrize("rows_per_program", [1, 4])
def test_sampler_ties_across_vocabulary_chunks(device, rows_per_program):
    """The shared kernel with small chunks, one row per program (as on GPUs) and several."""
    tuning = SamplerTuning(
        block_v=32, block_r=rows_per_program, interpreter_block_r=rows_per_program
    )
    checks.check_sampler_ties_across_chunks(make_sampler(96, tuning), device)


@pytest.mark.parametrize("out_dtype", DTYPES, ids=str)
def test_fp8_scaled_mm_matches_reference(platform, device, out_dtype):
    checks.check_scaled_mm(platform.scaled_mm(), device, out_dtype)


def test_fp8_scaled_mm_widened_for_chips_without_fp8(device):
    """sm_80's path: e4m3 bytes widened to float16 by bit moves, small tiles so K loops."""
    tiles = MatmulTuning(block_m=32, block_n=16, block_k=32, group_m=2)
    checks.check_scaled_mm(make_scaled_mm(tiles, widen=True), device, torch.bfloat16)


def test_fp8_per_token_quantisation(device):
    checks.check_per_token_quant(device)


def test_rejection_sampler_matches_reference(platform, device):
    checks.check_rejection_sampler(platform.rejection_sampler(), device)


def test_rejection_sampler_over_several_programs_and_chunks(device):
    """Small tiles: 4 requests per program, 16-token vocabulary chunks."""
    from octavo_triton.rejection_sampler import make_rejection_sampler

    tiles = SamplerTuning(block_v=16, block_r=4, interpreter_block_r=4)
    checks.check_rejection_sampler(make_rejection_sampler(tiles), device)
