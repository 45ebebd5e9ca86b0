"""What a finished or streaming request hands back to the user, with vLLM's names and fields."""

from __future__ import annotations

import dataclasses
import enum
from array import array
from typing import Optional, Union


class FinishReason(str, enum.Enum):
    """Why a sample ended; the value is the string users see in ``CompletionOutput``."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"  # the engine failed this request (see RequestOutput.error)


StopReason = Union[int, str, None]


@dataclasses.dataclass(slots=True)
class Logprob:
    """One candidate token's log-probability at one position.

    ``rank`` is the token's 1-based rank in the whole vocabulary at that position (1 = most
    likely); ``decoded_token`` is the token alone, decoded (None without a tokenizer).
    """

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


# One dict per position: token id -> Logprob, the chosen token first, then the top alternatives.
SampleLogprobs = list[dict[int, Logprob]]
# The same for the prompt; the first position has nothing to condition on, so it is None.
PromptLogprobs = list[Optional[dict[int, Logprob]]]


@dataclasses.dataclass(slots=True)
class RequestMetrics:
    """Wall-clock times (``time.time()`` seconds) of one request's life, for latency metrics."""

    arrival_time: float
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    finished_time: Optional[float] = None
    num_generation_tokens: int = 0
    # Seconds between successive engine steps that gave the request tokens (inter-token
    # latency), 8 bytes each.
    token_gaps: array = dataclasses.field(default_factory=lambda: array("d"))

    @property
    def time_to_first_token(self) -> Optional[float]:
        """Seconds from arrival to the first output token, or None before it."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclasses.dataclass(slots=True)
class CompletionOutput:
    """One of a request's ``n`` samples.

    ``finish_reason`` is ``"stop"`` (EOS, a stop token or a stop string), ``"length"``
    (``max_tokens`` or the model's length), ``"abort"`` or ``"error"`` (the engine failed it; see
    ``RequestOutput.error``), and None while it runs.
    ``stop_reason`` is the stop string or stop token id that ended it, None for EOS or length.
    ``cumulative_logprob`` and ``logprobs`` are None unless ``SamplingParams.logprobs`` is set.
    In delta mode ``text``, ``token_ids`` and ``logprobs`` hold only what is new since the
    previous output of this request.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: Optional[float]
    logprobs: Optional[SampleLogprobs]
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None

    def finished(self) -> bool:
        """True once this sample has a finish reason."""
        return self.finish_reason is not None


@dataclasses.dataclass(slots=True)
class RequestOutput:
    """Everything one request has produced so far (or, in delta mode, since its last output).

    ``outputs`` holds one CompletionOutput per sample, ordered by ``index``; in delta mode only
    the samples that produced something new are present. ``finished`` is True once every sample
    has finished. ``error`` says why the engine failed the request (its samples that failed
    have ``finish_reason == "error"``); other requests are not affected.
    """

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: Optional[list[int]]
    prompt_logprobs: Optional[PromptLogprobs]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: Optional[RequestMetrics] = None
    error: Optional[str] = None
