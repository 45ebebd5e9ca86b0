"""Lossless sampling: at speculated positions the emitted tokens follow the distribution of
decoding without speculation, for n-gram and draft-model drafts; the same test fails a
verifier that accepts every draft.

A small vocabulary is made of the tiny model's: a logit bias of +8 on four tokens and top-k 4
leave exactly those four. Each request emits four tokens (the first from the prompt, then up to
two drafts and the target's own token per step), and a two-sample chi-square test (p = 0.001)
compares the joint distributions of tokens 1-3 and of tokens 2-4 (64 values each). The prompt
cycles through the four, so n-gram lookup drafts the cycle (often accepted, often not); the
draft model is another random model, whose distribution differs from the target's (the accept
test must correct it).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from spec_helpers import draft, eagle, generate, gumiho, make_llm, mtp, ngram

from octavo import SamplingParams
from octavo.ops import reference

FOUR = (41, 97, 230, 388)
PROMPT = [1] + list(FOUR) * 3
NUM_SAMPLES = 1500
P_VALUE = 1e-3


def sample_tuples(llm, first_seed: int) -> Counter:
    params = [
        SamplingParams(
            temperature=1.0,
            top_k=4,
            logit_bias={t: 8.0 for t in FOUR},
            max_tokens=4,
            ignore_eos=True,
            seed=first_seed + i,
        )
        for i in range(NUM_SAMPLES)
    ]
    outputs = generate(llm, [PROMPT] * NUM_SAMPLES, params)
    return Counter(tuple(o.outputs[0].token_ids) for o in outputs)


def homogeneity_p_value(a: Counter, b: Counter) -> float:
    """Two-sample chi-square test of one distribution over the cells, cells with an expected
    count under 5 pooled into one."""
    n_a, n_b = sum(a.values()), sum(b.values())
    cells, pooled = [], (0, 0)
    for cell in set(a) | set(b):
        total = a[cell] + b[cell]
        if min(n_a, n_b) * total / (n_a + n_b) < 5:
            pooled = (pooled[0] + a[cell], pooled[1] + b[cell])
        else:
            cells.append((a[cell], b[cell]))
    if sum(pooled):
        cells.append(pooled)
    statistic = 0.0
    for count_a, count_b in cells:
        total = count_a + count_b
        for count, n in ((count_a, n_a), (count_b, n_b)):
            expected = n * total / (n_a + n_b)
            statistic += (count - expected) ** 2 / expected
    dof = len(cells) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(statistic / 2.0)))


@pytest.fixture(scope="module")
def plain_samples(target_model) -> Counter:
    samples = sample_tuples(make_llm(target_model), first_seed=0)
    assert {t for cell in samples for t in cell} == set(FOUR)  # the four-token vocabulary
    return samples


@pytest.fixture(params=["ngram", "draft-model", "eagle", "p-eagle", "gumiho", "mtp"])
def spec_llm(request, target_model, draft_model, eagle_head, p_eagle_head, gumiho_head):
    configs = {"ngram": ngram, "draft-model": lambda k: draft(draft_model, k)}
    configs["eagle"] = lambda k: eagle(eagle_head, k)
    configs["p-eagle"] = lambda k: eagle(p_eagle_head, k, parallel_drafting=True)
    configs["gumiho"] = lambda k: gumiho(gumiho_head, k + 1)  # two serial, one parallel
    configs["mtp"] = mtp
    return make_llm(target_model, configs[request.param](2))


def project(samples: Counter, window: slice) -> Counter:
    projected = Counter()
    for cell, count in samples.items():
        projected[cell[window]] += count
    return projected


def p_values(samples: Counter, plain: Counter) -> list[float]:
    windows = (slice(0, 3), slice(1, 4))
    return [homogeneity_p_value(project(samples, w), project(plain, w)) for w in windows]


def test_speculated_tokens_follow_the_plain_distribution(spec_llm, plain_samples):
    samples = sample_tuples(spec_llm, first_seed=NUM_SAMPLES)
    stats = spec_llm.engine.core.scheduler.spec_stats
    # Both outcomes of the accept test happen often, so both paths are under test.
    assert 0.1 * stats.num_draft_tokens < stats.num_accepted_tokens < 0.9 * stats.num_draft_tokens
    assert stats.num_drafts >= NUM_SAMPLES and len(stats.num_accepted_tokens_per_pos) == 2
    assert min(p_values(samples, plain_samples)) > P_VALUE


def test_the_test_fails_a_verifier_that_accepts_every_draft(spec_llm, plain_samples):
    verifier = spec_llm.engine.core.runner.speculation.verifier

    def accept_everything(draft_ids, counts, draft_probs, target, temperature, uniforms, noise):
        always = torch.full_like(uniforms, -1.0)  # -1 * q < p for any draft the target allows
        return reference.rejection_sample(
            draft_ids, counts, draft_probs, target, temperature, always, noise
        )

    verifier.rejection_sampler = accept_everything
    samples = sample_tuples(spec_llm, first_seed=2 * NUM_SAMPLES)
    assert min(p_values(samples, plain_samples)) < P_VALUE
