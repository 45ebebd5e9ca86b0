"""Internal paths of the cpu kernels that the conformance suite's small shapes never reach:
decode groups split by the workspace size, the top-p radix select, and the top-k tie fallback.
Each is compared with octavo.ops.reference (or its sort-based definition)."""

from __future__ import annotations

import torch

from octavo.ops import reference
from octavo.platform.types import AttentionSpec
from octavo.testing.conformance.paged_batches import run_scenario
from octavo.testing.conformance.sampling_cases import RowParams, make_metadata
from octavo_cpu import attention, kernels, sampler
from octavo_cpu.attention import CpuAttentionBackend


class OneBackend:
    """Stands in for a Platform in ``run_scenario``: hands out one given backend."""

    def __init__(self, backend):
        self.backend = backend

    def attention_backend(self, spec):
        return self.backend


def test_ragged_decodes_split_into_many_groups(monkeypatch):
    # A workspace of two blocks' K+V forces groups of one or two requests of unequal lengths.
    monkeypatch.setattr(attention, "WORKSPACE_BYTES", 2 * 2 * 2 * 4 * 8 * 4)
    prompts = [1, 9, 3, 17, 6, 12, 2]
    scenario = (
        tuple((r, 0, n) for r, n in enumerate(prompts)),
        tuple((r, n, 1) for r, n in enumerate(prompts)),
        tuple((r, n + 1, 1) for r, n in enumerate(prompts)) + ((7, 0, 5),),
    )
    for window in (None, 5):
        spec = AttentionSpec(4, 2, 8, torch.float32, 4, 0.3, sliding_window=window)
        torch_path = CpuAttentionBackend(spec, kernels._load("torch"))  # the grouping is its
        results = run_scenario(OneBackend(torch_path), spec, scenario, "cpu")
        for result in results:
            torch.testing.assert_close(result.actual, result.expected, atol=2e-5, rtol=1e-5)


def test_top_p_radix_select_matches_the_sorted_definition():
    gen = torch.Generator().manual_seed(0)
    probs = (torch.randn(16, 3000, generator=gen) * 0.5).softmax(-1)
    top_p = torch.rand(16, generator=gen) * 0.9 + 0.05
    expected = sampler.prefix_threshold(probs.sort(-1, descending=True).values, top_p)
    assert (probs.topk(128).values.sum(-1) < top_p).any(), "some rows must need the radix select"
    assert torch.equal(sampler.top_p_threshold(probs, top_p), expected)


def test_ties_at_the_kth_value_are_kept_on_the_candidate_path():
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0, 2.0]] * 400)
    params = [RowParams(1.0, 2, 1.0, 0.0, 4)] * 400
    metadata = make_metadata(params, torch.device("cpu"))
    one_row = make_metadata(params[:1], torch.device("cpu"))
    kept = torch.isfinite(reference.apply_top_k_top_p_min_p(logits[:1], one_row)[0])
    assert kept.tolist() == [True, False, True, True, False, True]
    torch.manual_seed(0)
    drawn = set(sampler.sample(logits, metadata).tolist())
    assert drawn == {0, 2, 3, 5}
