"""What a draft proposer is: after each step's sampling, up to K draft tokens for each request
that sampled. The n-gram and draft-model proposers implement it; trained draft heads add more.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional, Protocol

import numpy as np
import torch

if TYPE_CHECKING:
    from octavo.model_executor.input_batch import InputBatch


@dataclasses.dataclass(slots=True)
class ProposeContext:
    """One step as a proposer sees it, after the sampled tokens were appended to the batch.

    ``rows`` are the batch rows to propose for (each sampled this step: its tokens up to
    ``batch.num_tokens[row]`` are known, the last one without KV yet). ``step`` is the step's
    flat input (``octavo.model_executor.step_inputs.StepInputs``) and ``hidden_states`` the
    target model's output for it, for proposers that read them. ``process_logits(logits, rows,
    num_tokens, failed)`` runs the runner's logits processors (penalties, logit bias,
    min_tokens), for proposers that draft from a distribution: a draft written at
    ``batch.token_ids[row, batch.num_tokens[row] + j]`` counts for the positions after it. It
    is None where no processor adjusts any of the rows' logits.
    """

    batch: "InputBatch"
    rows: np.ndarray
    step: Any = None
    hidden_states: Optional[torch.Tensor] = None
    process_logits: Optional[Callable[..., torch.Tensor]] = None


class Proposer(Protocol):
    """Proposes drafts: ``propose(context) -> (drafts [len(rows), K] int64, num_drafts
    [len(rows)])``; row ``i``'s drafts are ``drafts[i, :num_drafts[i]]`` (0: none this step)."""

    needs_lookahead_slots: bool
    """True when the proposer writes KV past the scheduled tokens (a draft model proposing K
    tokens ahead): the scheduler then allocates K lookahead slots."""

    recompute_last_cached_block: bool
    """True when the proposer's KV at a position depends on the token after it (an EAGLE
    head): a prefix-cache hit then leaves out its last block, to be recomputed."""

    attention_layers: list
    """The proposer's own attention layers (a draft model's): the runner gives them KV caches
    beside the target's, on the same block ids."""

    def forward_step(self, step: Any, hidden_states: torch.Tensor) -> None:
        """Called after every target forward with its ``StepInputs`` and the target's hidden
        states for them (a draft model or head writes its own KV for the step's tokens)."""

    def propose(self, context: ProposeContext) -> tuple[np.ndarray, np.ndarray]: ...

    def draft_probs(
        self, batch: "InputBatch", rows: np.ndarray, num_drafts: np.ndarray
    ) -> Optional[torch.Tensor]:
        """``[sum(num_drafts), V]`` the distributions the verifying rows' drafts were drawn from,
        or None for point-mass drafts (n-gram)."""

    def forget(self, req_ids: Iterable[str]) -> None:
        """Drop what is kept for finished requests."""
