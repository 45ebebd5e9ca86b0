"""The cuda platform's Triton kernels against octavo.ops.reference (interpreter or GPU)."""

from __future__ import annotations

import pytest
import torch

from octavo_triton import kernel_checks as checks
from octavo_triton.sampler import make_sampler
from octavo_triton.fp8 import make_scaled_mm
from octavo_triton.tuning import MatmulTuning, SamplerTuning

pytestmark = pytest.mark.needs_kernels

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", checks.ATTENTION_CASES, ids=lambda c: c.name)
def test_paged_attention_matches_reference(platform, device, dtype, case):
    checks.check_attention(platform, device, dtype, case)


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
    tuning = SamplerTuning(block_v=32, block_r=rows_per_program, interpreter_block_r=rows_per_program)
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
