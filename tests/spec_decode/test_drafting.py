"""DraftDistributions: the distributions a step's verifying rows were drafted from, and greedy
drafts taken by the platform's sampler."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from octavo.ops import reference
from octavo.spec_decode.drafting import DraftDistributions

VOCAB, K = 8, 3


def _batch(*req_ids: str):
    return SimpleNamespace(req_ids=list(req_ids))


def _kept(distributions: DraftDistributions, req_id: str, seed: int) -> torch.Tensor:
    probs = torch.rand(K, VOCAB, generator=torch.Generator().manual_seed(seed))
    distributions._probs[req_id] = probs
    return probs


def test_every_verifying_row_greedy_gives_no_distributions():
    distributions = DraftDistributions(VOCAB, K, torch.device("cpu"), reference.sample)
    _kept(distributions, "b", seed=0)  # b samples, but verifies no draft this step
    rows, num_drafts = np.array([0, 1]), np.array([2, 0])
    assert distributions.draft_probs(_batch("a", "b"), rows, num_drafts) is None
    assert "b" not in distributions._probs  # taken all the same: its drafts were not verified


def test_greedy_rows_among_sampled_ones_get_zero_rows_in_row_order():
    distributions = DraftDistributions(VOCAB, K, torch.device("cpu"), reference.sample)
    kept_b = _kept(distributions, "b", seed=1)
    _kept(distributions, "d", seed=2)  # no drafts this step: no rows
    rows, num_drafts = np.array([0, 1, 2, 3]), np.array([1, 2, 3, 0])
    probs = distributions.draft_probs(_batch("a", "b", "c", "d"), rows, num_drafts)
    expected = torch.cat([torch.zeros(1, VOCAB), kept_b[:2], torch.zeros(3, VOCAB)])
    torch.testing.assert_close(probs, expected, rtol=0, atol=0)
    assert not distributions._probs  # each row's taken, with drafts this step or not


def test_greedy_drafts_are_the_samplers_for_all_greedy_rows():
    seen = []

    def sampler(logits, metadata):
        seen.append((logits.shape[0], metadata.all_greedy, metadata.temperature.tolist()))
        return reference.sample(logits, metadata)

    distributions = DraftDistributions(VOCAB, K, torch.device("cpu"), sampler)
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(3))
    drafts = distributions.argmax(logits)
    assert drafts.tolist() == logits.argmax(dim=-1).tolist()
    assert seen == [(3, True, [0.0, 0.0, 0.0])]
