"""The platform's ``rejection_sampler()``: greedy verification is exact, random verification
makes the reference's choices from the same draws, and what it emits follows the target
distribution whatever the draft proposed (the sampler is lossless)."""

from __future__ import annotations

import pytest
import torch

from octavo.errors import KernelNotAvailableError
from octavo.ops import reference
from octavo.testing.conformance.rejection_cases import random_case


@pytest.fixture(scope="module")
def verifier(octavo_platform):
    """The platform's verifier; the kernel is optional (only speculative decoding needs it)."""
    try:
        return octavo_platform.rejection_sampler()
    except KernelNotAvailableError as exc:
        pytest.skip(f"optional kernel not provided: {exc}")


def run(verifier, octavo_device, case):
    """The platform's verifier on the case's tensors moved to the device, back on the host."""
    ids, counts, draft, target, temperature, uniforms, noise = case
    to = lambda t: None if t is None else t.to(octavo_device)  # noqa: E731
    out = verifier(to(ids), counts, to(draft), to(target), to(temperature), to(uniforms), to(noise))
    assert out.dtype == torch.int64 and out.shape == (len(counts), max(counts, default=0) + 1)
    return out.cpu()


@pytest.mark.parametrize(
    "with_draft_probs", [False, True], ids=["point-mass-drafts", "draft-probs"]
)
def test_greedy_verification_is_exact(verifier, octavo_device, with_draft_probs):
    """Temperature 0: drafts are kept while they are the target's argmax (lowest index on
    ties), the first mismatch becomes the argmax, a fully accepted row gets the bonus argmax."""
    vocab = 6
    target = torch.full((9, vocab), 0.02)
    argmaxes = [4, 1, 2, 3, 0, 5, 2, 3, 1]  # rows: req 0: 0..3, req 1: 4, req 2: 5..8
    target[torch.arange(9), argmaxes] = 0.9
    target[5, 0] = 0.9  # a tie in row 5: index 0 wins
    ids = torch.tensor([4, 1, 2, 0, 2, 1])  # req 0: all 3 accepted; req 2: 0 and 2 kept, 1 != 3
    counts = [3, 0, 3]
    draft = torch.softmax(torch.randn(6, vocab, generator=torch.Generator().manual_seed(0)), -1)
    case = (
        ids,
        counts,
        draft if with_draft_probs else None,
        target,
        torch.zeros(3),
        torch.full((6,), 0.5),
        torch.ones(3, vocab),
    )
    expected = [[4, 1, 2, 3], [0, -1, -1, -1], [0, 2, 3, -1]]
    assert reference.rejection_sample(*case).tolist() == expected
    assert run(verifier, octavo_device, case).tolist() == expected


@pytest.mark.parametrize(
    "with_draft_probs", [False, True], ids=["point-mass-drafts", "draft-probs"]
)
@pytest.mark.parametrize("seed", [0, 1])
def test_random_verification_matches_the_reference(
    verifier, octavo_device, octavo_conformance_quick, with_draft_probs, seed
):
    """Mixed greedy and random requests, some without drafts, a vocabulary that is not a power
    of two: the same accepted drafts and the same recovered or bonus tokens as the reference
    from the same uniforms and noise."""
    if octavo_conformance_quick and seed:
        pytest.skip("quick mode: one seed")
    counts = [3, 0, 1, 4, 2, 0, 5, 1, 2]
    case = random_case(counts, 37, seed, with_draft_probs, greedy_rows=(1, 3, 6))
    expected = reference.rejection_sample(*case)
    lengths = (expected >= 0).sum(1)
    assert 1 < lengths.float().mean() < max(counts) + 1, (
        "the case should accept some drafts, not all"
    )
    assert torch.equal(run(verifier, octavo_device, case), expected)


def test_no_drafts_is_plain_sampling_of_the_bonus(verifier, octavo_device):
    """Requests without drafts emit one token each: the bonus position's argmax (greedy) or
    its exponential race."""
    case = random_case([0, 0, 0], 50, seed=3, with_draft_probs=False, greedy_rows=(1,))
    _, _, _, target, _, _, noise = case
    expected = (target / noise).argmax(-1)
    expected[1] = target[1].argmax()
    assert run(verifier, octavo_device, case)[:, 0].tolist() == expected.tolist()


def empirical(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).float() / max(tokens.numel(), 1)


@pytest.mark.parametrize(
    "with_draft_probs", [False, True], ids=["point-mass-drafts", "draft-probs"]
)
def test_emitted_tokens_follow_the_target_distribution(
    verifier, octavo_device, octavo_conformance_quick, with_draft_probs
):
    """Lossless: 4000 requests verify two drafts drawn from a draft distribution far from the
    target (total variation 0.6), or fixed guesses; each emitted position follows the target's
    distribution there (5 standard errors of slack, about 0.04 at the first position; a
    verifier that always accepts is off by 0.5 or more, one that recovers from the target
    instead of the residual by 0.1 or more)."""
    if octavo_conformance_quick and not with_draft_probs:
        pytest.skip("quick mode: point-mass drafts are checked against the reference above")
    num_reqs, vocab, k = 4000, 4, 2
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.4, 0.1]])
    q = torch.tensor([[0.1, 0.1, 0.2, 0.6], [0.6, 0.2, 0.1, 0.1]])
    gen = torch.Generator().manual_seed(1234)
    if with_draft_probs:
        ids = torch.multinomial(q, num_reqs, replacement=True, generator=gen).t().reshape(-1)
    else:  # an n-gram-like proposer: fixed guesses, a point mass on each
        ids = torch.tensor([0, 3]).repeat(num_reqs)
    target = p.repeat(num_reqs, 1)
    draft = q.repeat(num_reqs, 1) if with_draft_probs else None
    uniforms = torch.rand(num_reqs * k, generator=gen)
    noise = torch.empty(num_reqs, vocab).exponential_(generator=gen)
    case = (ids, [k] * num_reqs, draft, target, torch.ones(num_reqs), uniforms, noise)
    out = run(verifier, octavo_device, case)
    for position in range(k + 1):
        tokens = out[out[:, position] >= 0, position]  # rows whose drafts before it were all kept
        freq = empirical(tokens, vocab)
        slack = 5 * (p[position] * (1 - p[position]) / tokens.numel()).sqrt() + 1e-3
        assert ((freq - p[position]).abs() <= slack).all(), (
            f"position {position}: emitted {freq.tolist()} over {tokens.numel()} rows, "
            f"target {p[position].tolist()}"
        )
