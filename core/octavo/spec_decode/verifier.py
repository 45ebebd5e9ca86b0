"""Verification of a step's drafts: the target's logits at every draft position and the bonus
position, turned into what the platform's rejection sampler takes.

Request ``r`` verifying ``k_r`` drafts has ``k_r + 1`` logits rows (its draft positions, then the
bonus position), already adjusted by the logits processors for the tokens before each position.
Greedy rows are given to the sampler as those logits (it reads only their argmax, which is then
the very argmax decoding without speculation takes); sampled rows as probabilities after the
request's temperature, top-k, top-p and min-p, the distribution the normal sampler draws from.
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import numpy as np
import torch

from octavo.model_executor.step_inputs import ragged_index
from octavo.ops import reference
from octavo.platform.types import RejectionSamplerFn, SamplingMetadata


def positions_per_row(num_drafts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For rows verifying ``num_drafts [S]`` drafts: ``(row, offset)`` of each of the
    ``sum(k + 1)`` logits positions (row ``i``'s positions are offsets ``0 .. k_i``)."""
    return ragged_index(num_drafts + 1)


def target_distribution(logits: torch.Tensor, metadata: SamplingMetadata, row: torch.Tensor):
    """``[P, V]``: the logits of greedy positions, the sampling probabilities of the others;
    ``row [P]`` maps each position to its request in ``metadata``."""
    if metadata.all_greedy:
        return logits
    temperature = metadata.temperature.index_select(0, row)
    safe = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    scaled = logits / safe.unsqueeze(1)
    if not (metadata.no_top_k and metadata.no_top_p and metadata.no_min_p):
        per_position = SamplingMetadata(
            temperature=temperature,
            top_k=metadata.top_k.index_select(0, row),
            top_p=metadata.top_p.index_select(0, row),
            min_p=metadata.min_p.index_select(0, row),
        )
        scaled = reference.apply_top_k_top_p_min_p(scaled, per_position)
    probs = scaled.softmax(dim=-1)
    if metadata.all_random:
        return probs
    return torch.where((temperature > 0).unsqueeze(1), probs, logits)


@functools.lru_cache(maxsize=64)
def unread_draws(num_drafts: int, num_rows: int, vocab: int, device) -> tuple[torch.Tensor, ...]:
    """Stand-ins for the draws of an all-greedy step (which no sampler reads), made once per
    shape and shared by every such step: ``(uniforms [N] zeros, noise [R, V] ones)``. A
    rejection sampler never writes its inputs."""
    uniforms = torch.zeros(num_drafts, device=device)
    return uniforms, torch.ones(1, 1, device=device).expand(num_rows, vocab)


class DraftVerifier:
    """Verifies drafts with the platform's rejection sampler (``octavo_rejection_sampler``)."""

    def __init__(self, rejection_sampler: RejectionSamplerFn):
        self.rejection_sampler = rejection_sampler

    def __call__(
        self,
        logits: torch.Tensor,
        metadata: SamplingMetadata,
        num_drafts: Sequence[int],
        draft_token_ids: torch.Tensor,
        draft_probs: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """``[S, max_k + 1]`` int64: each row's accepted drafts, then the target's own token,
        then -1 (see ``RejectionSamplerFn``). ``logits [sum(k + 1), V]`` fp32, processed;
        ``draft_probs [sum(k), V]`` the proposer's (None: each draft a point mass)."""
        counts = np.asarray(num_drafts, dtype=np.int64)
        num_rows, vocab = len(counts), logits.shape[-1]
        if metadata.all_greedy:  # the logits as they are; no draws are read: keep the
            target = logits  # generators' streams untouched
            uniforms, noise = unread_draws(int(counts.sum()), num_rows, vocab, logits.device)
        else:
            row, _ = positions_per_row(counts)
            target = target_distribution(logits, metadata, torch.from_numpy(row).to(logits.device))
            uniforms, noise = reference.draw_rejection_randoms(
                counts.tolist(), vocab, metadata.generators, logits.device
            )
        return self.rejection_sampler(
            draft_token_ids,
            counts.tolist(),
            draft_probs,
            target,
            metadata.temperature,
            uniforms,
            noise,
        )
