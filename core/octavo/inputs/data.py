"""The shapes of a request's input: vLLM's prompt forms, the per-request options, and the
processed request that the engine accepts."""

from __future__ import annotations

import dataclasses
import numbers
import sys
from typing import Optional, Union

from octavo.lora.request import LoRARequest
from octavo.sampling_params import PRIORITY_MAX, PRIORITY_MIN, SamplingParams

if sys.version_info >= (3, 11):
    from typing import NotRequired, Required, TypedDict
else:  # pragma: no cover - Python 3.10
    from typing_extensions import NotRequired, Required, TypedDict


class TextPrompt(TypedDict):
    """A prompt as text, tokenised by the engine (with the tokenizer's special tokens)."""

    prompt: Required[str]
    cache_salt: NotRequired[str]


class TokensPrompt(TypedDict):
    """A prompt as token ids, used as given; ``prompt`` is its text when the caller has it
    (echoed back in the output, never tokenised)."""

    prompt_token_ids: Required[list[int]]
    prompt: NotRequired[str]
    cache_salt: NotRequired[str]


PromptType = Union[str, list[int], TextPrompt, TokensPrompt]
"""Text, token ids, or one of the two dicts."""


class PromptError(ValueError):
    """A prompt the engine cannot run: empty, tokens outside the vocabulary, or too long for the
    model's context (``code`` "context_length_exceeded", as OpenAI names it)."""

    def __init__(self, message: str, code: Optional[str] = None) -> None:
        super().__init__(message)
        self.code = code


@dataclasses.dataclass(frozen=True, slots=True)
class RequestOptions:
    """What a request carries besides its prompt and SamplingParams.

    ``priority``: lower runs first under ``--scheduling-policy priority``; ``cache_salt``: only
    requests with the same salt share prefix-cache blocks; ``arrival_time``: ``time.time()``
    when the request arrived (None: when it is processed); ``lora_request``: the LoRA adapter
    it runs with (None: the base model).
    """

    priority: int = 0
    cache_salt: Optional[str] = None
    arrival_time: Optional[float] = None
    lora_request: Optional[LoRARequest] = None

    def __post_init__(self) -> None:
        if isinstance(self.priority, bool) or not isinstance(self.priority, numbers.Integral):
            raise ValueError(f"priority must be an integer, got {self.priority!r}")
        object.__setattr__(self, "priority", int(self.priority))  # numpy ints become ints
        if not PRIORITY_MIN <= self.priority <= PRIORITY_MAX:
            raise ValueError(f"priority must be in [{PRIORITY_MIN}, {PRIORITY_MAX}]")
        if self.cache_salt is not None and not (
            isinstance(self.cache_salt, str) and self.cache_salt
        ):
            raise ValueError("cache_salt must be a non-empty string when given")


@dataclasses.dataclass(frozen=True, slots=True)
class ProcessedPrompt:
    """A prompt's token ids (checked against the model), and its text when it had one."""

    token_ids: tuple[int, ...]
    text: Optional[str] = None


@dataclasses.dataclass(frozen=True, slots=True)
class ProcessedRequest:
    """One user request, tokenised and checked against the model: its ``params`` fit the
    vocabulary, its prompt fits the context, and ``options.arrival_time`` is set. The engine
    takes it as it is (``LLMEngine.add_processed_request``)."""

    request_id: str
    prompt: ProcessedPrompt
    params: SamplingParams
    options: RequestOptions
