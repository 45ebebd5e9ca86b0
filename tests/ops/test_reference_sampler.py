"""octavo.ops.reference sampling: greedy, the documented top-k/top-p/min-p sets (checked against
plain-Python definitions), seeded reproducibility and the sampled distribution."""

from __future__ import annotations

import math
import random

import torch

from octavo.ops import reference
from octavo.platform.types import SamplingMetadata


def metadata(temperature, top_k=None, top_p=None, min_p=None, generators=None):
    rows = len(temperature)
    return SamplingMetadata(
        temperature=torch.tensor(temperature, dtype=torch.float32),
        top_k=torch.tensor(top_k or [0] * rows, dtype=torch.int32),
        top_p=torch.tensor(top_p or [1.0] * rows, dtype=torch.float32),
        min_p=torch.tensor(min_p or [0.0] * rows, dtype=torch.float32),
        generators=generators or {},
        all_greedy=all(t == 0 for t in temperature),
        all_random=all(t > 0 for t in temperature),
        no_top_k=top_k is None,
        no_top_p=top_p is None,
        no_min_p=min_p is None,
    )


def python_kept(logits: list[float], k: int, p: float, min_p: float) -> set[int]:
    """The docstring's definitions, one filter after another, in float64 Python."""
    kept = set(range(len(logits)))
    if 0 < k < len(logits):
        kth = sorted(logits, reverse=True)[k - 1]
        kept = {i for i in kept if logits[i] >= kth}
    top = max(logits[i] for i in kept)
    weights = {i: math.exp(logits[i] - top) for i in kept}
    total = sum(weights.values())
    if p < 1.0:
        mass, chosen = 0.0, set()
        for i in sorted(kept, key=lambda i: -logits[i]):
            if chosen and mass >= p:
                break
            chosen.add(i)
            mass += weights[i] / total
        kept = chosen
    if min_p > 0:
        best = max(weights[i] for i in kept)
        kept = {i for i in kept if weights[i] >= min_p * best}
    return kept


def test_greedy_is_argmax_with_lowest_index_on_ties():
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0], [5.0, -1.0, 5.0, 0.0], [0.1, 0.2, 0.3, 0.4]])
    assert reference.sample(logits, metadata([0.0, 0.0, 0.0])).tolist() == [1, 0, 3]
    mixed = metadata([0.0, 0.0, 1.0], top_k=[0, 0, 1])  # top-k 1 on a row without ties
    assert reference.sample(logits, mixed).tolist() == [1, 0, 3]


def test_filters_keep_exactly_the_documented_sets():
    rng = random.Random(0)
    rows, params = [], []
    for _ in range(200):
        # A coarse grid makes ties common, so "ties at the k-th value are kept" is exercised.
        # Top-p does not say which of two tied tokens goes first, so its rows get no ties.
        row = [rng.randrange(-12, 12) / 4 for _ in range(20)]
        k = rng.choice([0, 0, 1, 3, 7, 25])
        p = rng.choice([1.0, 1.0, rng.random()])
        if p < 1.0:
            row = [x + rng.random() * 0.2 for x in row]
        rows.append(row)
        params.append((k, p, rng.choice([0.0, 0.0, rng.random() * 0.8])))
    logits = torch.tensor(rows)
    k, p, m = ([row[i] for row in params] for i in range(3))
    masked = reference.apply_top_k_top_p_min_p(logits, metadata([1.0] * 200, k, p, m))
    for i, row in enumerate(rows):
        kept = set(torch.isfinite(masked[i]).nonzero().flatten().tolist())
        assert kept == python_kept(row, *params[i]), f"row {i} params {params[i]}"


def test_top_p_one_keeps_even_negligible_tokens():
    logits = torch.tensor([[0.0, -40.0, -60.0] + [0.0] * 5])
    masked = reference.apply_top_k_top_p_min_p(logits, metadata([1.0], top_p=[1.0]))
    assert torch.isfinite(masked).all()


def test_seeded_rows_do_not_depend_on_the_batch():
    gen = torch.Generator().manual_seed(0)
    a, b, c = torch.randn(3, 50, generator=gen)

    def draws(batch, seeds, global_seed):
        gens = {row: torch.Generator().manual_seed(seed) for row, seed in seeds.items()}
        meta = metadata([1.0] * len(batch), generators=gens)
        torch.manual_seed(global_seed)
        return torch.stack([reference.sample(torch.stack(batch), meta) for _ in range(5)], 1)

    first = draws([a, b], {0: 11}, global_seed=0)
    second = draws([c, c, a, b], {2: 11}, global_seed=1)
    assert first[0].tolist() == second[2].tolist()
    assert first[1].tolist() != second[3].tolist()  # unseeded rows follow the global RNG


def test_draws_follow_the_temperature_scaled_softmax():
    logits = torch.tensor([1.5, 1.0, 0.2, -0.5, -1.0, 0.7])
    draws = 4000
    batch = logits.repeat(draws, 1)
    torch.manual_seed(0)
    tokens = reference.sample(batch, metadata([0.8] * draws, top_k=[4] * draws))
    keep = torch.tensor([True, True, True, False, False, True])
    expected = (logits / 0.8).masked_fill(~keep, float("-inf")).softmax(-1).double()
    observed = torch.bincount(tokens, minlength=6).double() / draws
    sigma = (expected * (1 - expected) / draws).sqrt()
    assert ((observed - expected).abs() <= 5 * sigma + 1 / draws).all(), (observed, expected)
