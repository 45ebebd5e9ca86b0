"""Batched sampling on the host CPU: greedy, temperature, top-k, top-p, min-p.

Work is skipped by the metadata's flags (``all_greedy``, ``no_top_k``, ...). A draw is one
uniform per row mapped through the row's cumulative distribution (inverse CDF in float64),
not the reference's exponential race over the whole vocabulary: one random number per row
instead of ``V`` (the race's ``exponential_`` alone costs more than everything else here).
Seeded rows take their uniform from their own generator, so they are reproducible whatever
the batch; the tokens differ from the reference's for the same seed.

When every row has a top-k, everything happens on the ``topk`` candidates (sorted, a few
dozen per row) instead of the vocabulary. Otherwise the filters work on full rows: top-k
masks below the k-th value, top-p finds its cut-off among the 128 most likely tokens when
they hold enough mass (almost always with a trained model) and by a radix select on the
probabilities' bits otherwise, never sorting the vocabulary; min-p masks below
``min_p * max_prob``. Ties at a cut-off are kept.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

from octavo.platform.types import SamplingMetadata

TOP_P_CANDIDATES = 128
HALF_OR_FLOAT = (torch.float32, torch.bfloat16, torch.float16)


def uniforms(num_rows: int, metadata: SamplingMetadata, device) -> torch.Tensor:
    """U[0, 1) per row in float64; seeded rows draw from their own generator."""
    u = torch.rand(num_rows, dtype=torch.float64, device=device)
    for row, generator in metadata.generators.items():
        u[row] = torch.rand(1, dtype=torch.float64, generator=generator, device=device)[0]
    return u


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Column index per row drawn with probability proportional to ``weights`` (>= 0).

    The target ``u * total`` is kept strictly below the total (even where rounding would
    reach it), so the chosen column always has positive weight."""
    cdf = weights.cumsum(dim=-1, dtype=torch.float64)
    total = cdf[:, -1]
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target.unsqueeze(1), right=True).squeeze(1)


def prefix_threshold(sorted_probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The smallest probability top-p keeps, from each row's probabilities sorted descending:
    token ``i`` is kept while the mass before it is below ``p``."""
    mass_before = sorted_probs.cumsum(dim=-1).sub_(sorted_probs)
    num_kept = (mass_before < top_p.unsqueeze(1)).sum(dim=-1, keepdim=True).clamp_(min=1)
    return sorted_probs.gather(1, num_kept - 1)


def radix_threshold(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The largest probability ``t`` with ``sum(probs[probs >= t]) >= p``, by a three-level
    radix select on the float32 bit patterns (ordered like the values for non-negative
    floats): each level histograms the mass of the surviving bucket by the next 10-11 bits
    and keeps the bin where the mass from the top reaches ``p``. Seven passes over the rows
    instead of a sort."""
    bits = probs.view(torch.int32)
    num_rows = probs.shape[0]
    prefix = torch.zeros(num_rows, 1, dtype=torch.int32)
    above = torch.zeros(num_rows, 1, dtype=torch.float64)  # mass of buckets above this one
    top_p = top_p.double().unsqueeze(1)
    key = torch.empty(probs.shape, dtype=torch.int64)
    for shift, width in ((20, 11), (10, 10), (0, 10)):
        num_bins = 1 << width
        # Bin 0 gathers what lies below the current bucket, bin num_bins + 1 what lies above.
        relative = torch.bitwise_right_shift(bits - prefix, shift).clamp_(-1, num_bins)
        torch.add(relative, 1, out=key)
        hist = torch.zeros(num_rows, num_bins + 2).scatter_add_(1, key, probs)
        hist = hist[:, 1 : num_bins + 1].double()
        from_top = hist.flip(1).cumsum(1).flip(1) + above
        b = ((from_top >= top_p).sum(1, keepdim=True) - 1).clamp_(min=0)
        above = from_top.gather(1, b) - hist.gather(1, b)
        prefix = prefix + torch.bitwise_left_shift(b.int(), shift)
    return prefix.view(torch.float32)


def top_p_threshold(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per-row top-p cut-off for full rows of probabilities (0 where top-p is off)."""
    candidates = probs.topk(min(TOP_P_CANDIDATES, probs.shape[-1]), dim=-1).values
    threshold = prefix_threshold(candidates, top_p)
    short = (candidates.sum(dim=-1) < top_p) & (top_p < 1.0)
    if bool(short.any()):
        rows = short.nonzero().flatten()
        threshold[rows] = radix_threshold(probs[rows], top_p[rows])
    return threshold.masked_fill_((top_p >= 1.0).unsqueeze(1), 0.0)


def filter_probs_(probs: torch.Tensor, metadata: SamplingMetadata, sorted_rows: bool) -> None:
    """Zero (in place) what top-p, then min-p exclude from already top-k-filtered probs."""
    if not metadata.no_top_p:
        if sorted_rows:
            threshold = prefix_threshold(probs, metadata.top_p)
            threshold.masked_fill_((metadata.top_p >= 1.0).unsqueeze(1), 0.0)
        else:
            threshold = top_p_threshold(probs, metadata.top_p)
        probs.masked_fill_(probs < threshold, 0.0)
    if not metadata.no_min_p:
        floor = probs.amax(dim=-1, keepdim=True) * metadata.min_p.unsqueeze(1)
        probs.masked_fill_(probs < floor, 0.0)


def sample_top_k_candidates(logits, temperature, metadata: SamplingMetadata):
    """Every row has a top-k: sample among ``topk`` candidates. None if a tie straddles a
    row's k-th value (the full-row path keeps such ties)."""
    vocab = logits.shape[-1]
    k = metadata.top_k.long()
    k_max = int(k.max())
    values, indices = logits.topk(min(k_max + 1, vocab), dim=-1)
    kth = values.gather(1, (k - 1).unsqueeze(1))
    if values.shape[1] > k_max and bool((values.gather(1, k.unsqueeze(1)) == kth).any()):
        return None
    values, indices = values[:, :k_max], indices[:, :k_max]
    scaled = values.float().div(temperature.unsqueeze(1))
    scaled.masked_fill_(torch.arange(k_max) >= k.unsqueeze(1), float("-inf"))
    probs = scaled.softmax(dim=-1)
    filter_probs_(probs, metadata, sorted_rows=True)
    choice = inverse_cdf(probs, uniforms(probs.shape[0], metadata, probs.device))
    return indices.gather(1, choice.unsqueeze(1)).squeeze(1)


def sample_full_rows(logits, temperature, metadata: SamplingMetadata) -> torch.Tensor:
    """Filters and the draw over whole vocabulary rows."""
    scaled = logits.float().div(temperature.unsqueeze(1))
    if not metadata.no_top_k:
        vocab = scaled.shape[-1]
        k = metadata.top_k.long()
        active = (k > 0) & (k < vocab)
        k = torch.where(active, k, torch.ones_like(k))
        kth = scaled.topk(int(k.max()), dim=-1).values.gather(1, (k - 1).unsqueeze(1))
        kth.masked_fill_(~active.unsqueeze(1), float("-inf"))
        scaled.masked_fill_(scaled < kth, float("-inf"))
    probs = scaled.softmax(dim=-1)
    filter_probs_(probs, metadata, sorted_rows=False)
    return inverse_cdf(probs, uniforms(probs.shape[0], metadata, probs.device))


def torch_argmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)


def make_argmax(ops=None) -> Callable[[torch.Tensor], torch.Tensor]:
    """Each row's argmax of ``[R, V]`` logits by the compiled ``argmax_rows`` (``ops``: the
    loaded library's ops, see octavo_cpu.kernels; the same index as torch's argmax, first on
    ties; ~4x faster on a decode batch's logits, ~7x on a verify step's few rows, where torch's
    costs ~55 us), else by torch's."""
    if ops is None:
        return torch_argmax

    def compiled_argmax(logits: torch.Tensor) -> torch.Tensor:
        fits = logits.dim() == 2 and logits.is_contiguous() and logits.dtype in HALF_OR_FLOAT
        if not fits or not 0 < logits.shape[1] < 1 << 24:
            return logits.argmax(dim=-1)
        out = torch.empty(logits.shape[0], dtype=torch.long)
        ops.argmax_rows(out, logits)
        return out

    return compiled_argmax


def make_sampler(ops=None) -> Callable[[torch.Tensor, SamplingMetadata], torch.Tensor]:
    """``sample`` with greedy rows taken by ``make_argmax(ops)``."""
    if ops is None:
        return sample
    return functools.partial(sample, argmax=make_argmax(ops))


def sample(logits: torch.Tensor, metadata: SamplingMetadata, argmax=torch_argmax) -> torch.Tensor:
    """One token id per row of ``logits [R, V]`` (not modified); int64 ``[R]``.

    A seeded row is sampled on its own, so which path it takes (top-k candidates or full
    rows) and every rounding it sees depend on that row alone: a seeded request draws the same
    tokens whatever else is in the batch. Unseeded rows are sampled together. ``argmax`` takes
    the greedy rows' tokens.
    """
    if metadata.all_greedy or logits.shape[0] == 0:
        return argmax(logits)
    if not metadata.generators or (len(metadata.generators) == 1 and logits.shape[0] == 1):
        return _sample_rows(logits, metadata, argmax)
    sampled = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    seeded = sorted(metadata.generators)
    for row in seeded:
        one = _sample_rows(logits[row : row + 1], _select_rows(metadata, [row]), argmax)
        sampled[row] = one[0]
    rest = sorted(set(range(logits.shape[0])) - set(seeded))
    if rest:
        sampled[rest] = _sample_rows(logits[rest], _select_rows(metadata, rest), argmax)
    return sampled


def _select_rows(metadata: SamplingMetadata, rows: list[int]) -> SamplingMetadata:
    """The metadata of ``rows`` only (generators re-keyed to their new positions)."""
    index = torch.tensor(rows, dtype=torch.long)
    temperature, top_k = metadata.temperature[index], metadata.top_k[index]
    top_p, min_p = metadata.top_p[index], metadata.min_p[index]
    generators = {
        i: metadata.generators[row] for i, row in enumerate(rows) if row in metadata.generators
    }
    return SamplingMetadata(
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        generators=generators,
        all_greedy=bool((temperature == 0).all()),
        all_random=bool((temperature > 0).all()),
        no_top_k=metadata.no_top_k or bool((top_k <= 0).all()),
        no_top_p=metadata.no_top_p or bool((top_p >= 1.0).all()),
        no_min_p=metadata.no_min_p or bool((min_p <= 0.0).all()),
    )


def _sample_rows(logits: torch.Tensor, metadata: SamplingMetadata, argmax) -> torch.Tensor:
    """Sample rows together: the top-k candidate path when every row has a top-k."""
    if metadata.all_greedy:
        return argmax(logits)
    temperature = metadata.temperature.float()
    if not metadata.all_random:
        temperature = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    sampled = None
    top_k = metadata.top_k
    if not metadata.no_top_k and bool(((top_k > 0) & (top_k < logits.shape[-1])).all()):
        sampled = sample_top_k_candidates(logits, temperature, metadata)
    if sampled is None:
        sampled = sample_full_rows(logits, temperature, metadata)
    if metadata.all_random:
        return sampled
    return torch.where(metadata.temperature > 0, sampled, argmax(logits))
