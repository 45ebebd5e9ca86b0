"""The reference speculative-decoding verifier: by hand on small cases, lossless in distribution,
and seeded draws that do not depend on the rest of the batch."""

from __future__ import annotations

import torch

from octavo.ops import reference


def test_random_verification_by_hand():
    """Request 0: draft 1 (p 0.6, q 0.8) is kept when u * 0.8 < 0.6, i.e. u < 0.75; draft 2
    (p 0.1, q 0.5) is rejected for u = 0.5, and the token is drawn from max(p - q, 0) = only
    token 0 left. Request 1 has no drafts: its bonus is argmax(p / noise)."""
    target = torch.tensor(
        [
            [0.2, 0.6, 0.2],
            [0.5, 0.4, 0.1],
            [0.3, 0.3, 0.4],  # request 0: drafts 0, 1, bonus
            [0.1, 0.1, 0.8],  # request 1: bonus
        ]
    )
    draft = torch.tensor([[0.1, 0.8, 0.1], [0.1, 0.4, 0.5]])
    args = (torch.tensor([1, 2]), [2, 0], draft, target, torch.ones(2))
    noise = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 9.0]])  # request 1: 0.8 / 9 loses to 0.1
    out = reference.rejection_sample(*args, torch.tensor([0.7, 0.5]), noise)
    assert out.tolist() == [[1, 0, -1], [0, -1, -1]]
    out = reference.rejection_sample(
        *args, torch.tensor([0.8, 0.5]), noise
    )  # u 0.8: draft 1 rejected too
    assert out[0].tolist() == [
        0,
        -1,
        -1,
    ]  # max(p - q) = [0.1, 0, 0.1]: token 0 wins the tie at equal noise


def test_point_mass_drafts_recover_without_the_rejected_token():
    """Without draft probabilities a rejected draft cannot come back as the recovered token."""
    target = torch.tensor([[0.9, 0.1, 0.0], [0.3, 0.3, 0.4]])
    out = reference.rejection_sample(
        torch.tensor([0]), [1], None, target, torch.ones(1), torch.tensor([0.95]), torch.ones(1, 3)
    )
    assert out.tolist() == [[1, -1]]


def test_empty_batches():
    out = reference.rejection_sample(
        torch.zeros(0, dtype=torch.int64),
        [],
        None,
        torch.zeros(0, 5),
        torch.zeros(0),
        torch.zeros(0),
        torch.zeros(0, 5),
    )
    assert out.shape == (0, 1)


def test_lossless_against_a_far_draft():
    """Two drafts from a distribution far from the target: every emitted position follows the
    target distribution (20000 requests, 4 standard errors)."""
    num_reqs, p = 20000, torch.tensor([[0.7, 0.2, 0.1], [0.2, 0.2, 0.6], [0.3, 0.4, 0.3]])
    q = torch.tensor([[0.1, 0.3, 0.6], [0.6, 0.3, 0.1]])
    gen = torch.Generator().manual_seed(0)
    ids = torch.multinomial(q, num_reqs, replacement=True, generator=gen).t().reshape(-1)
    uniforms, noise = (
        torch.rand(2 * num_reqs, generator=gen),
        torch.empty(num_reqs, 3).exponential_(generator=gen),
    )
    out = reference.rejection_sample(
        ids,
        [2] * num_reqs,
        q.repeat(num_reqs, 1),
        p.repeat(num_reqs, 1),
        torch.ones(num_reqs),
        uniforms,
        noise,
    )
    for position in range(3):
        tokens = out[out[:, position] >= 0, position]
        freq = torch.bincount(tokens, minlength=3).float() / tokens.numel()
        assert (
            (freq - p[position]).abs()
            <= 4 * (p[position] * (1 - p[position]) / tokens.numel()).sqrt()
        ).all()


def test_seeded_draws_ignore_the_rest_of_the_batch():
    counts = [2, 3, 1]
    seeded = lambda: {1: torch.Generator().manual_seed(5)}  # noqa: E731
    u1, n1 = reference.draw_rejection_randoms(counts, 7, seeded())
    u2, n2 = reference.draw_rejection_randoms([4, 3], 7, {1: torch.Generator().manual_seed(5)})
    torch.testing.assert_close(u1[2:5], u2[4:7], atol=0, rtol=0)
    torch.testing.assert_close(n1[1], n2[1], atol=0, rtol=0)
    assert u1.shape == (6,) and n1.shape == (3, 7) and bool((n1 > 0).all()) and bool((u1 < 1).all())
