"""The rocm platform's kernels beyond the conformance suite (interpreter or GPU).

The conformance suite (``pytest --pyargs octavo.testing.conformance --octavo-platform rocm``,
run by the same CI leg) checks every kernel against ``octavo.ops.reference``. Here: the
platform's own RMSNorm (column blocks over a persistent grid, and fused with FP8 quantisation),
its split-vocabulary sampler, and the exact-race promise of its samplers (the reference's
tokens).
"""

from __future__ import annotations

import pytest
import torch

from octavo.ops import reference
from octavo_rocm.rms_norm import make_rms_norm, make_rms_norm_fp8
from octavo_rocm.sampler import make_sampler
from octavo_rocm.tuning import TUNING
from octavo_triton import testing

pytestmark = pytest.mark.needs_kernels

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_walks_wide_rows_in_column_blocks(device, dtype):
    """Rows wider than one block take the two-pass path; the persistent grid has fewer
    programs than rows."""
    gen = torch.Generator().manual_seed(0)
    x, residual = (torch.randn(9, 200, generator=gen).to(dtype) for _ in range(2))
    weight = (torch.rand(200, generator=gen) + 0.5).to(dtype)
    fn = make_rms_norm(200, 1e-6, max_block=64, num_programs=4)
    out, summed = fn(x.to(device), weight.to(device), residual.to(device))
    expected, expected_sum = reference.rms_norm(x, weight, 1e-6, residual)
    assert torch.equal(summed.cpu(), expected_sum)
    testing.assert_close(out, expected)
    testing.assert_close(fn(x.to(device), weight.to(device)), reference.rms_norm(x, weight, 1e-6))


@pytest.mark.parametrize("case", testing.SAMPLING_CASES, ids=lambda c: c.name)
def test_sampler_draws_the_reference_tokens(platform, device, case):
    logits = testing.random_logits(len(case.temperature), 64, device)
    testing.assert_draws_like_reference(platform.sampler(64), device, case, logits)


def test_split_vocabulary_sampler_across_many_slices(device):
    """Unfiltered batches split the vocabulary: the winner of 5 slices is the reference's
    token; greedy ties across slices go to the lowest index."""
    sampler = make_sampler(150, TUNING.sampler, min_split=32)
    case = testing.SAMPLING_CASES[-1]
    logits = testing.random_logits(len(case.temperature), 150, device)
    logits[2, [40, 140]] = 25.0  # the greedy row: a tie between slices 1 and 4
    for seed in range(3):
        torch.manual_seed(seed)
        got = sampler(logits, testing.sampling_metadata(case, device, seed))
        torch.manual_seed(seed)
        expected = reference.sample(logits, testing.sampling_metadata(case, device, seed))
        assert got.tolist() == expected.tolist() and got[2].item() == 40
    greedy = testing.SamplingCase(
        "greedy", (0.0,) * 4, (0,) * 4, (1.0,) * 4, (0.0,) * 4, (None,) * 4
    )
    got = sampler(logits, testing.sampling_metadata(greedy, device, 0))
    assert got.tolist() == [3, int(logits[1].argmax()), 40, int(logits[3].argmax())]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "fused-add"])
def test_rms_norm_fused_with_fp8_quantisation(device, dtype, with_residual):
    """AITER's add + RMSNorm + per-token FP8 quant in one pass equals RMSNorm then quantising:
    the reference's output, scaled by its row maximum over 448 and rounded to e4m3."""
    gen = torch.Generator().manual_seed(1)
    x, residual = (torch.randn(7, 200, generator=gen).to(dtype) for _ in range(2))
    weight = (torch.rand(200, generator=gen) + 0.5).to(dtype)
    fn = make_rms_norm_fp8(200, 1e-6, torch.float8_e4m3fn, num_programs=3)
    got = fn(x.to(device), weight.to(device), residual.to(device) if with_residual else None)
    expected = reference.rms_norm(x, weight, 1e-6, residual if with_residual else None)
    if with_residual:
        assert torch.equal(got[2].cpu(), expected[1])
        expected = expected[0]
    scale = (expected.float().abs().amax(1, keepdim=True) / 448).clamp(min=1 / (448 * 512))
    torch.testing.assert_close(got[1].cpu(), scale, rtol=1e-5, atol=0)
    quantised = (expected.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float()
    assert (got[0].cpu().float() == quantised).float().mean() > 0.99  # 16-bit ties may round apart
    torch.testing.assert_close(
        got[0].cpu().float() * got[1].cpu(), expected.float(), rtol=0.07, atol=1e-2
    )
