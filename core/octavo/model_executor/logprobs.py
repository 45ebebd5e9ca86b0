"""Log-probabilities of sampled tokens and their top alternatives, computed batched in fp32,
as the one-position ``StepLogprobs`` rows the output side consumes."""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from octavo.model_executor.runner_output import StepLogprobs
from octavo.model_executor.step_inputs import ragged_index


def compute_logprobs(
    logits: torch.Tensor, sampled: torch.Tensor, num_logprobs: np.ndarray
) -> list[Optional[StepLogprobs]]:
    """For each row of ``logits [S, V]`` whose ``num_logprobs`` is >= 0: the sampled token's
    logprob and rank and the ``num_logprobs`` most likely tokens (``log_softmax`` in fp32).
    Rows with ``num_logprobs`` -1 get None."""
    out: list[Optional[StepLogprobs]] = [None] * len(num_logprobs)
    rows = np.flatnonzero(num_logprobs >= 0)
    if len(rows) == 0:
        return out
    index = torch.from_numpy(rows).to(logits.device)
    logprobs = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)
    # Clamped: a row the sampler found no token for (the runner fails that request) must not
    # index out of range here first.
    chosen = sampled.index_select(0, index).long().clamp_(0, logits.shape[-1] - 1)
    chosen_logprobs = logprobs.gather(1, chosen.unsqueeze(1))
    ranks = (logprobs > chosen_logprobs).sum(dim=1) + 1
    k = int(num_logprobs[rows].max())
    top_values, top_ids = (
        logprobs.topk(k, dim=-1) if k > 0 else (logprobs[:, :0], chosen[:, None][:, :0])
    )
    chosen_list, chosen_lp = chosen.tolist(), chosen_logprobs.squeeze(1).tolist()
    ranks_list, top_ids_list, top_values_list = (
        ranks.tolist(),
        top_ids.tolist(),
        top_values.tolist(),
    )
    for i, row in enumerate(rows.tolist()):
        n = int(num_logprobs[row])
        out[row] = StepLogprobs(
            token_ids=[[chosen_list[i], *top_ids_list[i][:n]]],
            logprobs=[[chosen_lp[i], *top_values_list[i][:n]]],
            ranks=[ranks_list[i]],
        )
    return out


def emitted_logprobs(
    logits: torch.Tensor, tokens: np.ndarray, num_drafts: np.ndarray, num_logprobs: np.ndarray
) -> list[Optional[StepLogprobs]]:
    """Logprobs of each row's emitted tokens after draft verification: ``tokens [S, W]`` (-1
    padded) were emitted at row ``i``'s logits positions ``0, 1, ...``, which start at row
    ``sum(k_j + 1 for j < i)`` of ``logits``. One StepLogprobs of as many positions per row that
    asked for logprobs (``num_logprobs`` >= 0), None for the others."""
    out: list[Optional[StepLogprobs]] = [None] * len(num_logprobs)
    if not (num_logprobs >= 0).any():
        return out
    counts = (tokens >= 0).sum(axis=1)
    starts = np.cumsum(num_drafts + 1) - (num_drafts + 1)
    row, offset = ragged_index(counts)
    position = starts[row] + offset
    index = torch.from_numpy(position).to(logits.device)
    chosen = torch.from_numpy(tokens[tokens >= 0]).to(logits.device)
    per_position = compute_logprobs(logits.index_select(0, index), chosen, num_logprobs[row])
    first = np.cumsum(counts) - counts
    for i in np.flatnonzero(num_logprobs >= 0).tolist():
        rows = per_position[first[i] : first[i] + counts[i]]
        out[i] = StepLogprobs(
            token_ids=[r.token_ids[0] for r in rows],
            logprobs=[r.logprobs[0] for r in rows],
            ranks=[r.ranks[0] for r in rows],
        )
    return out
