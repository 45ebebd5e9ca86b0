"""The platform's ``sampler(vocab_size)``: greedy is exact, random rows stay inside the top-k /
top-p / min-p set, seeded rows are reproducible, and draws follow the softmax."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from octavo.testing.conformance.sampling_cases import (
    RowSpec,
    allowed_tokens,
    expected_probs,
    make_metadata,
    row_params,
)

VOCAB = 257  # not a power of two: tiles that assume one must mask their tail


def spaced_logits(num_rows: int, vocab: int, seed: int, spacing: float = 0.08) -> torch.Tensor:
    """Rows whose sorted logits are evenly spaced (with jitter of under 40% of the spacing,
    so they stay distinct), in a random token order."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(num_rows):
        jitter = 0.375 * spacing * torch.rand(vocab, generator=generator)
        values = -spacing * torch.arange(vocab) + jitter
        rows.append(values[torch.randperm(vocab, generator=generator)])
    return torch.stack(rows)


def test_greedy_is_argmax(octavo_platform, octavo_device):
    """All-greedy batches return argmax, the lowest index on ties."""
    sampler = octavo_platform.sampler(VOCAB)
    logits = spaced_logits(5, VOCAB, seed=0)
    logits[3, 17] = logits[3, 200] = logits[3].max() + 1.0  # a tie: token 17 must win
    params = [row_params(row, RowSpec(0.0)) for row in logits]
    metadata = make_metadata(params, octavo_device)
    tokens = sampler(logits.to(octavo_device, copy=True), metadata)
    assert tokens.dtype == torch.int64 and tokens.shape == (5,)
    assert tokens.cpu().tolist() == logits.argmax(-1).tolist()
    assert tokens[3].item() == 17


def test_greedy_finds_the_last_token(octavo_platform, octavo_device):
    """An argmax at the vocabulary's last token (a tail that tiles must mask, not drop)."""
    sampler = octavo_platform.sampler(VOCAB)
    logits = spaced_logits(3, VOCAB, seed=7)
    logits[1, VOCAB - 1] = logits[1].max() + 1.0
    metadata = make_metadata([row_params(row, RowSpec(0.0)) for row in logits], octavo_device)
    tokens = sampler(logits.to(octavo_device, copy=True), metadata).cpu()
    assert tokens.tolist() == logits.argmax(-1).tolist() and tokens[1].item() == VOCAB - 1


def test_empty_batch(octavo_platform, octavo_device):
    """No rows in, no tokens out (with filters on)."""
    sampler = octavo_platform.sampler(VOCAB)
    logits = torch.zeros(0, VOCAB, device=octavo_device)
    for spec in (RowSpec(0.0), RowSpec(1.0, keep_top_k=5, keep_top_p=3)):
        params = [row_params(spaced_logits(1, VOCAB, seed=0)[0], spec)]
        metadata = make_metadata(params, octavo_device)
        metadata = dataclasses.replace(
            metadata,
            temperature=metadata.temperature[:0],
            top_k=metadata.top_k[:0],
            top_p=metadata.top_p[:0],
            min_p=metadata.min_p[:0],
        )
        tokens = sampler(logits, metadata)
        assert tokens.shape == (0,) and tokens.dtype == torch.int64


def test_greedy_rows_in_a_mixed_batch(octavo_platform, octavo_device):
    """Temperature-0 rows stay argmax when other rows sample (with filters on)."""
    sampler = octavo_platform.sampler(VOCAB)
    logits = spaced_logits(6, VOCAB, seed=1)
    specs = [
        RowSpec(0.0),
        RowSpec(1.0, keep_top_k=5),
        RowSpec(0.0),
        RowSpec(0.8, keep_top_p=4),
        RowSpec(1.2, keep_min_p=3),
        RowSpec(0.0),
    ]
    params = [row_params(row, spec) for row, spec in zip(logits, specs)]
    metadata = make_metadata(params, octavo_device)
    tokens = sampler(logits.to(octavo_device, copy=True), metadata).cpu()
    for row in (0, 2, 5):
        assert tokens[row].item() == logits[row].argmax().item(), f"greedy row {row}"


# Rows mixing filters (some rows without top-k), and batches where every row has a top-k
# (a kernel may then work on the top-k candidates alone).
MIXED_SPECS = (
    RowSpec(1.0, keep_top_k=5),
    RowSpec(0.7, keep_top_p=4),
    RowSpec(1.5, keep_min_p=6),
    RowSpec(1.0, keep_top_k=12, keep_top_p=7, keep_min_p=3),
    RowSpec(0.9, keep_top_p=1),
    RowSpec(2.0),
)
ALL_TOP_K_SPECS = (
    RowSpec(1.0, keep_top_k=5),
    RowSpec(0.7, keep_top_k=40, keep_top_p=4),
    RowSpec(1.5, keep_top_k=9, keep_min_p=6),
    RowSpec(1.0, keep_top_k=12, keep_top_p=7, keep_min_p=3),
    RowSpec(2.0, keep_top_k=1),
)


def draw_within_allowed(sampler, device, logits, specs, copies, seed):
    """Sample ``copies`` draws of each row; assert each lies in its allowed set."""
    logits = logits.repeat_interleave(copies, 0)
    params = [row_params(row, specs[i // copies]) for i, row in enumerate(logits)]
    torch.manual_seed(seed)
    metadata = make_metadata(params, device)
    tokens = sampler(logits.to(device, copy=True), metadata).cpu()
    assert tokens.shape == (len(logits),) and tokens.dtype == torch.int64
    for i, (row, p) in enumerate(zip(logits, params)):
        token = tokens[i].item()
        assert token in allowed_tokens(row, p.num_allowed), (
            f"row {i} ({specs[i // copies]}) drew token {token}, "
            f"outside its {p.num_allowed} allowed"
        )
    return logits, tokens


@pytest.mark.parametrize("specs", (MIXED_SPECS, ALL_TOP_K_SPECS), ids=("mixed", "all_top_k"))
def test_random_rows_stay_in_the_allowed_set(octavo_platform, octavo_device, specs):
    """Every draw is one of the tokens top-k, then top-p, then min-p keep."""
    sampler = octavo_platform.sampler(VOCAB)
    logits = spaced_logits(len(specs), VOCAB, seed=2)
    logits, tokens = draw_within_allowed(sampler, octavo_device, logits, specs, 48, seed=0)
    off_greedy = (tokens != logits.argmax(-1)).sum().item()
    assert off_greedy > len(logits) // 4, "random rows nearly always drew the argmax"


def test_top_p_over_a_flat_distribution(octavo_platform, octavo_device):
    """Top-p that keeps 200 near-equal tokens: no shortcut may cap the candidates."""
    sampler = octavo_platform.sampler(VOCAB)
    logits = spaced_logits(1, VOCAB, seed=6, spacing=0.005)
    specs = (RowSpec(1.0, keep_top_p=200),)
    _, tokens = draw_within_allowed(sampler, octavo_device, logits, specs, 96, seed=3)
    rank = logits[0].argsort(descending=True).argsort()
    assert (rank[tokens] >= 128).any(), "no draw beyond the 128 most likely tokens"


def test_top_k_beyond_vocab_means_all_tokens(octavo_platform, octavo_device):
    """A top-k larger than the vocabulary filters nothing (and does not crash)."""
    sampler = octavo_platform.sampler(VOCAB)
    logits = spaced_logits(1, VOCAB, seed=3).repeat(64, 1)
    params = [row_params(row, RowSpec(5.0)) for row in logits]
    params = [dataclasses.replace(p, top_k=VOCAB + 5) for p in params]
    torch.manual_seed(1)
    metadata = make_metadata(params, octavo_device)
    tokens = sampler(logits.to(octavo_device, copy=True), metadata).cpu()
    assert ((tokens >= 0) & (tokens < VOCAB)).all()
    assert len(set(tokens.tolist())) > 8


def test_top_k_keeps_every_tie_at_its_cut_off(octavo_platform, octavo_device):
    """Four tokens tie for the top value, spread across the vocabulary: a top-k of 2 keeps all
    four (as the reference does: ties at the cut-off are kept), and nothing else."""
    sampler = octavo_platform.sampler(VOCAB)
    logits = spaced_logits(1, VOCAB, seed=8).repeat(64, 1)
    ties = [5, 90, 170, VOCAB - 1]
    logits[:, ties] = logits.max() + 1.0
    params = [dataclasses.replace(row_params(logits[0], RowSpec(1.0)), top_k=2)] * 64
    torch.manual_seed(4)
    metadata = make_metadata(params, octavo_device)
    tokens = sampler(logits.to(octavo_device, copy=True), metadata).cpu().tolist()
    assert set(tokens) <= set(ties), f"drew {sorted(set(tokens) - set(ties))}, not a tied token"
    assert len(set(tokens)) > 2, f"64 draws over four tied tokens hit only {sorted(set(tokens))}"


def seeded_draws(sampler, device, rows, seeds_by_row, num_steps, global_seed):
    """Tokens per step for a batch of ``(logits row, RowSpec)`` whose rows listed in
    ``seeds_by_row`` have generators."""
    generators = {
        row: torch.Generator(device=device).manual_seed(seed) for row, seed in seeds_by_row.items()
    }
    params = [row_params(logits, spec) for logits, spec in rows]
    metadata = make_metadata(params, device, generators)
    torch.manual_seed(global_seed)
    logits = torch.stack([logits for logits, _ in rows]).to(device)
    steps = [sampler(logits.clone(), metadata).cpu() for _ in range(num_steps)]
    return torch.stack(steps, dim=1)


def test_seeded_rows_do_not_depend_on_the_batch(octavo_platform, octavo_device):
    """A seeded row draws the same tokens whatever its neighbours, position or global RNG,
    also when the neighbours change which filters the batch as a whole needs."""
    sampler = octavo_platform.sampler(VOCAB)
    a, b, c, d = spaced_logits(4, VOCAB, seed=4)
    plain, filtered = RowSpec(1.0), RowSpec(1.0, keep_top_k=40, keep_top_p=25)
    top_k, greedy = RowSpec(0.8, keep_top_k=10), RowSpec(0.0)
    for spec in (plain, filtered):
        # In the first batch every row has a top-k when ``spec`` has; in the second, none.
        neighbour = top_k if spec is filtered else plain
        first_rows = [(a, spec), (c, neighbour), (b, spec)]
        second_rows = [(d, plain), (b, spec), (d, greedy), (a, spec)]
        first = seeded_draws(sampler, octavo_device, first_rows, {0: 7, 2: 9}, 6, 0)
        second = seeded_draws(sampler, octavo_device, second_rows, {3: 7, 1: 9}, 6, 1)
        assert first[0].tolist() == second[3].tolist(), f"seed 7 ({spec}) drew differently"
        assert first[2].tolist() == second[1].tolist(), f"seed 9 ({spec}) drew differently"
    other = seeded_draws(sampler, octavo_device, [(a, plain)], {0: 8}, 6, 0)
    alone = seeded_draws(sampler, octavo_device, [(a, plain)], {0: 7}, 6, 0)
    assert other[0].tolist() != alone[0].tolist(), "seeds 7 and 8 drew the same six tokens"


DISTRIBUTION_SPECS = {
    "mixed": (
        RowSpec(0.7, keep_top_k=6),
        RowSpec(1.3, keep_top_p=7),
        RowSpec(1.0, keep_min_p=5),
        RowSpec(1.0),
    ),
    "all_top_k": (
        RowSpec(0.7, keep_top_k=6),
        RowSpec(1.3, keep_top_k=9, keep_top_p=5),
        RowSpec(1.0, keep_top_k=8, keep_min_p=4),
    ),
}


@pytest.mark.parametrize("case", sorted(DISTRIBUTION_SPECS))
def test_draws_follow_the_filtered_softmax(
    octavo_platform, octavo_device, octavo_conformance_quick, case
):
    """Empirical frequencies over many draws match softmax(logits / T) over the allowed set."""
    vocab = 10
    sampler = octavo_platform.sampler(vocab)
    base = torch.tensor([2.0, 1.6, 1.1, 0.9, 0.4, 0.0, -0.3, -0.8, -1.5, -2.0])
    generator = torch.Generator().manual_seed(5)
    specs = DISTRIBUTION_SPECS[case]
    rows = [base[torch.randperm(vocab, generator=generator)] for _ in specs]
    draws = 400 if octavo_conformance_quick else 1500
    logits = torch.stack(rows).repeat_interleave(draws, 0)
    params = [row_params(rows[i], spec) for i, spec in enumerate(specs)]
    metadata = make_metadata([p for p in params for _ in range(draws)], octavo_device)
    torch.manual_seed(2)
    tokens = sampler(logits.to(octavo_device, copy=True), metadata).cpu()
    tokens = tokens.view(len(specs), draws)
    for i, (row, p) in enumerate(zip(rows, params)):
        expected = expected_probs(row, p)
        observed = torch.bincount(tokens[i], minlength=vocab).double() / draws
        sigma = (expected * (1 - expected) / draws).sqrt()
        # 5 sigma per token: a correct sampler fails this about once in a million runs.
        bound = 5 * sigma + 1.0 / draws
        assert ((observed - expected).abs() <= bound).all(), (
            f"row {specs[i]}: observed {observed.tolist()} expected {expected.tolist()}"
        )
