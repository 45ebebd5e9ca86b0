"""Per-request sampling parameters, validated as vLLM users expect."""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

MAX_N = 128
MAX_LOGPROBS = 20


def _require(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{field} {message}")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample one request's output.

    ``temperature`` 0 is greedy. ``top_k`` 0 (or -1) and ``top_p`` 1.0 and ``min_p`` 0.0 are off.
    ``stop`` strings end the output and are not included in it; ``stop_token_ids`` end it with
    the token kept. ``logprobs``/``prompt_logprobs``: how many top alternatives to return per
    position (None: no logprobs). Invalid values raise ``ValueError`` naming the field and range.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Optional[dict[int, float]] = None
    stop: Union[None, str, tuple[str, ...]] = None
    stop_token_ids: tuple[int, ...] = ()
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        # Normalise list inputs so the object stays hashable-friendly and immutable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is not None:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        self._validate()

    def _validate(self) -> None:
        _require(isinstance(self.n, int) and 1 <= self.n <= MAX_N, "n", f"must be an integer in [1, {MAX_N}], got {self.n!r}")
        _require(self.temperature >= 0, "temperature", f"must be >= 0 (0 is greedy), got {self.temperature!r}")
        _require(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p!r}")
        _require(isinstance(self.top_k, int) and self.top_k >= 0, "top_k", f"must be an integer >= 0 (0 or -1 disables it), got {self.top_k!r}")
        _require(0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {self.min_p!r}")
        _require(-2 <= self.presence_penalty <= 2, "presence_penalty", f"must be in [-2, 2], got {self.presence_penalty!r}")
        _require(-2 <= self.frequency_penalty <= 2, "frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty!r}")
        _require(self.repetition_penalty > 0, "repetition_penalty", f"must be > 0 (1 disables it), got {self.repetition_penalty!r}")
        _require(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1), "max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        _require(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens", f"must be an integer >= 0, got {self.min_tokens!r}")
        _require(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens", f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens!r}")
        for field in ("logprobs", "prompt_logprobs"):
            value = getattr(self, field)
            _require(value is None or (isinstance(value, int) and 0 <= value <= MAX_LOGPROBS), field, f"must be an integer in [0, {MAX_LOGPROBS}] or None, got {value!r}")
        _require(all(isinstance(s, str) and s for s in self.stop or ()), "stop", "must be non-empty strings")
        _require(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids", "must be non-negative integers")
        for token_id, bias in (self.logit_bias or {}).items():
            _require(-100 <= bias <= 100, "logit_bias", f"values must be in [-100, 100], got {bias!r} for token {token_id}")
        _require(self.seed is None or isinstance(self.seed, int), "seed", f"must be an integer or None, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
