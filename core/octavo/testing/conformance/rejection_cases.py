"""Random speculative-decoding verification cases, shared by the conformance suite and the
platforms' kernel tests."""

from __future__ import annotations

import torch


def layout_rows(counts):
    """Target rows of each request's draft positions (request r starts at row cu_r + r)."""
    rows, first = [], 0
    for r, k in enumerate(counts):
        rows.append([first + r + i for i in range(k + 1)])
        first += k
    return rows


def random_case(counts, vocab, seed, with_draft_probs, greedy_rows=()):
    """Spread-out target/draft distributions, drafts sampled from the draft's (so some are
    accepted and some not), per-request temperature 0 on ``greedy_rows``, and the draws."""
    gen = torch.Generator().manual_seed(seed)
    num_drafts, num_reqs = sum(counts), len(counts)
    target = torch.softmax(torch.randn(num_drafts + num_reqs, vocab, generator=gen) * 2, -1)
    draft = torch.softmax(torch.randn(num_drafts, vocab, generator=gen) * 2, -1)
    if num_drafts:
        ids = torch.multinomial(draft, 1, generator=gen)[:, 0]
    else:
        ids = torch.zeros(0, dtype=torch.int64)
    # Every other greedy request proposes the target's argmaxes, so greedy accepts too.
    for r in greedy_rows[::2]:
        rows = layout_rows(counts)[r][:-1]
        first = sum(counts[:r])
        ids[first : first + len(rows)] = target[rows].argmax(-1)
    temperature = torch.tensor([0.0 if r in greedy_rows else 1.0 for r in range(num_reqs)])
    uniforms = torch.rand(num_drafts, generator=gen)
    noise = torch.empty(num_reqs, vocab).exponential_(generator=gen)
    return ids, counts, draft if with_draft_probs else None, target, temperature, uniforms, noise
