"""What the model runner hands back for one step: sampled tokens and their logprobs, per request,
in the shape the output side consumes."""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence


@dataclasses.dataclass(slots=True)
class StepLogprobs:
    """Log-probabilities the runner computed for consecutive positions of one request (fp32
    ``log_softmax`` of the model's logits, before any sampling transform).

    Row ``r`` is one position. Column 0 of ``token_ids``/``logprobs`` is the chosen token (the
    sampled one, or for prompt logprobs the prompt's actual next token); columns 1.. are the top
    alternatives in descending order (at least as many as the request asked for). ``ranks[r]``
    is the chosen token's 1-based rank in the vocabulary (1 + how many tokens were more likely).
    Lists, numpy arrays or CPU tensors.
    """

    token_ids: Sequence[Sequence[int]]
    logprobs: Sequence[Sequence[float]]
    ranks: Sequence[int]

    def num_positions(self) -> int:
        """How many positions (rows) this holds."""
        return len(self.ranks)


@dataclasses.dataclass(slots=True)
class ModelRunnerOutput:
    """Sampled tokens per scheduled request, in batch order; empty lists where nothing was
    sampled (partial prefill chunks). ``logprobs[i]`` is one row per sampled token when request
    ``i`` asked for logprobs, else None. ``failed`` maps the requests the step could not sample
    for (their logits processing failed, or no token was left) to why: they end with an error,
    the others go on. A request that verified drafts gets its accepted drafts and one more token
    in ``sampled_token_ids``."""

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    logprobs: list[Optional[StepLogprobs]]
    failed: dict[str, str] = dataclasses.field(default_factory=dict)
    spec_token_ids: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    """Drafts proposed for each request's next step (speculative decoding; empty without)."""

    @classmethod
    def empty(cls) -> "ModelRunnerOutput":
        return cls([], [], [])
