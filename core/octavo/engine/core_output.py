"""What the engine core reports per step and per engine request: the output side's input."""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

from octavo.model_executor.runner_output import StepLogprobs
from octavo.outputs.types import FinishReason, StopReason


@dataclasses.dataclass(slots=True)
class EngineCoreOutput:
    """What one engine step produced for one engine request.

    ``new_logprobs`` has one row per new token when the request asked for logprobs;
    ``new_prompt_logprobs`` one row per newly computed prompt position after the first (for
    n > 1, reported on the child with index 0). ``finish_reason`` is set when the core itself
    ended the request (an abort, the model's length, or an ``error``, described by ``error``);
    the core may also leave every stop check to the processor.
    """

    request_id: str
    new_token_ids: Sequence[int] = ()
    new_logprobs: Optional[StepLogprobs] = None
    new_prompt_logprobs: Optional[StepLogprobs] = None
    finish_reason: Optional[FinishReason] = None
    stop_reason: StopReason = None
    error: Optional[str] = None
