"""The cuda platform's Triton kernels beyond the conformance suite (interpreter or GPU).

The conformance suite (``pytest --pyargs octavo.testing.conformance --octavo-platform cuda``, run
by the same CI leg) checks every kernel against ``octavo.ops.reference``. Here: the NVIDIA tiles
where the interpreter would not use them (split-KV), the shared kernels with tiles small enough
to cross their program and chunk boundaries, sm_80's widened FP8 path, the per-token FP8
quantisation, and the exact-race promise of the shared sampler (the reference's tokens).
"""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from octavo.ops import reference
from octavo.platform import AttentionSpec
from octavo.testing.conformance.paged_batches import build_metadata, run_scenario
from octavo.testing.conformance.rejection_cases import random_case
from octavo.testing.conformance.scaled_mm_cases import make_operands
from octavo_cuda.tuning import TUNING
from octavo_triton import testing
from octavo_triton.attention import TritonAttentionBackend
from octavo_triton.fp8 import make_per_token_quant, make_scaled_mm
from octavo_triton.rejection_sampler import make_rejection_sampler
from octavo_triton.sampler import make_sampler
from octavo_triton.tuning import MatmulTuning, SamplerTuning

pytestmark = pytest.mark.needs_kernels

# (spec, scenario) pairs that split contexts into several segments: decodes over long contexts
# (GQA 4), then short chunks under a sliding window (MQA). Chunks: (request, context, new).
SPLIT_KV_SCENARIOS = {
    "decodes-long-contexts": (
        (8, 2, 32, 16, None),
        (((0, 0, 150), (1, 0, 37), (2, 0, 90)), ((0, 150, 1), (1, 37, 1), (2, 90, 1))),
    ),
    "short-chunks-sliding-window": (
        (4, 1, 16, 8, 50),
        (((0, 0, 120), (1, 0, 70)), ((0, 120, 2), (1, 70, 1))),
    ),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", sorted(SPLIT_KV_SCENARIOS))
def test_split_kv_with_the_gpu_tiles(device, dtype, name):
    """The cuda tiles (16-row query blocks, 64-token context tiles) and split-KV over 3-5
    segments of one tile, each merged by the second kernel, within an ulp of the reference."""
    (heads, kv_heads, head_dim, block_size, window), scenario = SPLIT_KV_SCENARIOS[name]
    spec = AttentionSpec(heads, kv_heads, head_dim, dtype, block_size, 1.0, window)
    gpu = TUNING.attention_for(head_dim)
    forced = dataclasses.replace(
        gpu,
        split_kv_segment_len=64,
        split_kv_max_programs=1 << 30,
        interpreter_block_m=gpu.block_m,
        interpreter_tile_n=gpu.tile_n,
        interpreter_kv_write_tokens=gpu.kv_write_tokens,
        interpreter_split_kv_segment_len=32,
    )
    backend = TritonAttentionBackend(spec, forced)
    max_blocks = -(-160 // block_size)
    tables = torch.arange(3 * max_blocks, dtype=torch.int32).view(3, max_blocks)
    last = build_metadata(scenario[-1], tables, block_size)
    assert backend.num_segments(last, last.num_actual_tokens) >= 3
    shim = types.SimpleNamespace(attention_backend=lambda _: backend)
    for result in run_scenario(shim, spec, scenario, device, seed=1):
        testing.assert_close(result.actual, result.expected)


@pytest.mark.parametrize("case", testing.SAMPLING_CASES, ids=lambda c: c.name)
def test_sampler_draws_the_reference_tokens(platform, device, case):
    logits = testing.random_logits(len(case.temperature), 64, device)
    testing.assert_draws_like_reference(platform.sampler(64), device, case, logits)


@pytest.mark.parametrize("rows_per_program", [1, 4])
def test_sampler_ties_across_vocabulary_chunks(device, rows_per_program):
    """Small chunks, one row per program (as on GPUs) and several: four ties for the top value
    spread over several chunks. top-k keeps every tie (the reference's tokens); top-p keeps ties
    in index order while the mass before each is below ``p`` (a stable sort's order: the
    reference's unstable sort leaves that open)."""
    rows = rows_per_program
    sampler = make_sampler(96, SamplerTuning(block_v=32, block_r=rows, interpreter_block_r=rows))
    logits = testing.random_logits(4, 96, device)
    ties = [5, 40, 70, 90]
    logits[:, ties] = 15.0
    case = testing.SamplingCase(
        "ties", (1.0,) * 4, (2, 0, 3, 0), (1.0, 0.3, 1.0, 0.6), (0.0,) * 4, (1, 2, 3, 4)
    )
    drawn = {1: set(), 3: set()}
    for seed in range(2):
        got = sampler(logits, testing.sampling_metadata(case, device, seed)).tolist()
        expected = reference.sample(logits, testing.sampling_metadata(case, device, seed))
        assert [got[0], got[2]] == [expected[0], expected[2]], f"seed {seed}: {got}"
        drawn[1].add(got[1])
        drawn[3].add(got[3])
    assert drawn[1] <= set(ties[:2]) and drawn[3] <= set(ties[:3]), drawn


def test_fp8_scaled_mm_widened_for_chips_without_fp8(device):
    """sm_80's path: e4m3 bytes widened to float16 by bit moves, small tiles so K loops."""
    scaled_mm = make_scaled_mm(MatmulTuning(block_m=32, block_n=16, block_k=32, group_m=2), True)
    for index, shape in enumerate(((5, 40, 24), (33, 96, 17))):
        for scales in ("tensor x tensor", "token x channel"):
            ops = make_operands(shape, scales, torch.bfloat16, True, seed=index)
            on = ops.to(device)
            got = scaled_mm(on.a, on.b, on.scale_a, on.scale_b, torch.bfloat16, on.bias)
            expected = reference.scaled_mm(
                ops.a, ops.b, ops.scale_a, ops.scale_b, torch.bfloat16, ops.bias
            )
            testing.assert_close(got, expected)


def test_fp8_per_token_quantisation(device):
    """Dynamic per-token quantisation: ``scale = amax / fp8_max`` per row and ``q`` the
    round-to-nearest FP8 value of ``x / scale`` (as torch casts), zero rows included."""
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    x = torch.randn(7, 300, generator=torch.Generator().manual_seed(5)) * 3
    x[3] = 0.0
    q, scale = make_per_token_quant(torch.float8_e4m3fn, block_k=128)(x.to(device))
    expected_scale = (x.abs().amax(1, keepdim=True) / fp8_max).clamp(min=1.0 / (fp8_max * 512.0))
    assert torch.equal(scale.cpu(), expected_scale)
    expected = (x / expected_scale).clamp(-fp8_max, fp8_max).to(torch.float8_e4m3fn)
    assert torch.equal(q.cpu().float(), expected.float())


def test_rejection_sampler_over_several_programs_and_chunks(device):
    """Small tiles (4 requests per program, 16-token vocabulary chunks): the reference's tokens
    from the same draws, with and without draft probabilities."""
    verify = make_rejection_sampler(SamplerTuning(block_v=16, block_r=4, interpreter_block_r=4))
    counts = [2, 0, 4, 1, 3, 3, 0, 5, 1, 2, 4]
    for seed, with_draft_probs in ((0, False), (1, True)):
        case = random_case(counts, 37, seed, with_draft_probs, greedy_rows=(0, 4, 7))
        on_device = [t.to(device) if isinstance(t, torch.Tensor) else t for t in case]
        got = verify(*on_device)
        expected = reference.rejection_sample(*case)
        assert torch.equal(got.cpu(), expected), f"seed {seed}: {got.tolist()}"
