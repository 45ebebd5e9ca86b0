"""Batched sampling on the host CPU: greedy, temperature, top-k, top-p, min-p.

Work is skipped by the metadata's flags (``all_greedy``, ``no_top_k``, ...). top-k takes the
k-th value from ``topk`` of the largest k in the batch rather than a full sort; top-p sorts only
those top-k candidates when every top-p row also has a top-k, and the whole row otherwise;
min-p compares logits with ``max + log(min_p)``, which equals comparing probabilities with
``min_p * max_prob``. Draws use the reference's exponential race with the same noise (global
generator for every row, then each seeded row's own generator), so with equal inputs and seeds
this sampler picks the reference's tokens.
"""

from __future__ import annotations

import torch

from octavo.platform.types import SamplingMetadata

NEG_INF = float("-inf")


def top_k_threshold(scaled: torch.Tensor, top_k: torch.Tensor):
    """Per-row k-th largest value (-inf where top-k is off) and the sorted top candidates."""
    vocab = scaled.shape[-1]
    k = top_k.long()
    active = (k > 0) & (k < vocab)
    k = torch.where(active, k, torch.ones_like(k))
    candidates = scaled.topk(int(k.max()), dim=-1).values
    kth = candidates.gather(1, (k - 1).unsqueeze(1))
    return kth.masked_fill_(~active.unsqueeze(1), NEG_INF), candidates, active


def top_p_threshold(sorted_logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per-row smallest logit top-p keeps (-inf where top-p is off), given each row's
    candidates sorted descending with everything outside them already masked."""
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1).sub_(probs)
    num_kept = (mass_before < top_p.unsqueeze(1)).sum(dim=-1, keepdim=True).clamp_(min=1)
    threshold = sorted_logits.gather(1, num_kept - 1)
    return threshold.masked_fill_((top_p >= 1.0).unsqueeze(1), NEG_INF)


def apply_filters_(scaled: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Mask (in place) what top-k, then top-p, then min-p exclude."""
    candidates = None
    if not metadata.no_top_k:
        kth, candidates, has_top_k = top_k_threshold(scaled, metadata.top_k)
        scaled.masked_fill_(scaled < kth, NEG_INF)
    if not metadata.no_top_p:
        # The top-k candidates suffice unless some top-p row has no top-k.
        if candidates is not None and not bool(((metadata.top_p < 1.0) & ~has_top_k).any()):
            sorted_logits = candidates.masked_fill(candidates < kth, NEG_INF)
        else:
            sorted_logits = scaled.sort(dim=-1, descending=True).values
        scaled.masked_fill_(scaled < top_p_threshold(sorted_logits, metadata.top_p), NEG_INF)
    if not metadata.no_min_p:
        floor = scaled.amax(dim=-1, keepdim=True) + metadata.min_p.log().unsqueeze(1)
        scaled.masked_fill_(scaled < floor, NEG_INF)
    return scaled


def exponential_noise_(probs: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Exp(1) noise shaped like ``probs``; seeded rows redraw from their own generators."""
    noise = torch.empty_like(probs).exponential_()
    for row, generator in metadata.generators.items():
        noise[row].exponential_(generator=generator)
    return noise


def sample(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """One token id per row of ``logits [R, V]`` (not modified); int64 ``[R]``."""
    if metadata.all_greedy:
        return logits.argmax(dim=-1)
    temperature = metadata.temperature.float()
    if not metadata.all_random:
        temperature = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    scaled = logits.float().div(temperature.unsqueeze(1))
    apply_filters_(scaled, metadata)
    probs = scaled.softmax(dim=-1)
    sampled = probs.div_(exponential_noise_(probs, metadata)).argmax(dim=-1)
    if metadata.all_random:
        return sampled
    return torch.where(metadata.temperature > 0, sampled, logits.argmax(dim=-1))
