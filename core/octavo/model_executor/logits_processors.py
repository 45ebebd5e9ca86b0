"""Per-request logits adjustments before sampling: repetition, frequency and presence penalties,
logit bias and min_tokens, with vLLM's (and OpenAI's) meanings.

Only rows whose request asks for one of them are touched; each is handled with tensor ops over
the vocabulary (one Python iteration per such request, none per token).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from octavo.errors import RequestError
from octavo.model_executor.input_batch import CachedRequestState, InputBatch
from octavo.sampling_params import SamplingParams


class SamplingPenalties:
    """The runner's logits processor for penalties, logit bias and min_tokens."""

    def __init__(self, requests: dict[str, CachedRequestState], eos_token_ids: Sequence[int]):
        self.requests = requests
        self.eos_token_ids = tuple(eos_token_ids)

    def applies_to(self, batch: InputBatch, rows: np.ndarray) -> bool:
        return bool(batch.adjusts_logits[rows].any())

    def __call__(
        self, logits: torch.Tensor, batch: InputBatch, rows: np.ndarray, num_tokens: np.ndarray
    ) -> torch.Tensor:
        req_ids = batch.req_ids
        failed = {}
        for i in np.flatnonzero(batch.adjusts_logits[rows]).tolist():
            row, length = int(rows[i]), int(num_tokens[i])
            state = self.requests[req_ids[row]]
            if state.req_id not in failed:
                try:
                    self._apply(logits[i], state.sampling_params, batch, row, length)
                except Exception as exc:  # noqa: BLE001 - one request's parameters: fail it alone
                    failed[state.req_id] = (
                        f"cannot apply its penalties: {type(exc).__name__}: {exc}"
                    )
        if failed:
            raise RequestError(failed)
        return logits

    def _apply(
        self,
        row_logits: torch.Tensor,
        params: SamplingParams,
        batch: InputBatch,
        row: int,
        num_tokens: int,
    ) -> None:
        """Adjust the logits of the token after the row's first ``num_tokens`` tokens."""
        num_prompt = int(batch.num_prompt_tokens[row])
        tokens = torch.from_numpy(batch.token_ids[row, :num_tokens]).long().to(row_logits.device)
        output = tokens[num_prompt:]
        vocab = row_logits.shape[-1]
        if params.repetition_penalty != 1.0:
            seen = torch.zeros(vocab, dtype=torch.bool, device=row_logits.device)
            seen[tokens] = True
            penalty = params.repetition_penalty
            values = row_logits[seen]
            row_logits[seen] = torch.where(values > 0, values / penalty, values * penalty)
        if params.frequency_penalty or params.presence_penalty:
            counts = torch.bincount(output, minlength=vocab).to(row_logits.dtype)
            row_logits -= params.frequency_penalty * counts + params.presence_penalty * (
                counts > 0
            ).to(row_logits.dtype)
        if params.logit_bias:
            ids = torch.tensor(list(params.logit_bias), dtype=torch.long, device=row_logits.device)
            row_logits[ids] += torch.tensor(
                list(params.logit_bias.values()), dtype=row_logits.dtype, device=row_logits.device
            )
        if params.min_tokens and len(output) < params.min_tokens:
            banned = list(params.stop_token_ids) + (
                [] if params.ignore_eos else list(self.eos_token_ids)
            )
            if banned:
                row_logits[torch.tensor(banned, dtype=torch.long, device=row_logits.device)] = (
                    float("-inf")
                )
