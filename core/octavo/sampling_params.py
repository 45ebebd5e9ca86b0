"""Per-request sampling parameters, validated as vLLM users expect."""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
import re
from typing import Any, Optional, Sequence, Union

from octavo.structured_output.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

# The bounds of each request field, shared with the server's request models (which publish them
# in /openapi.json): a value outside them is refused where it is parsed, never in the step.
MAX_N = 128
MAX_LOGPROBS = 20
MAX_TOP_K = 2**31 - 1  # samplers hold top_k as int32; the engine clamps it to the vocabulary
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts
MAX_TEMPERATURE = 3.4e38  # the largest float32: the step divides logits by it in float32
MIN_TEMPERATURE = 1e-2  # smaller positive temperatures are raised to it, as vLLM does
# Logits are divided or multiplied by it in float32: 1e-300 is 0 there and gave infinite logits.
# Far narrower than what float32 holds, and far wider than any setting in use (1.0-2.0).
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 1e-2, 1e2
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-2, 2], as OpenAI's
MAX_LOGIT_BIAS = 100.0
PRIORITY_MIN, PRIORITY_MAX = -(2**63), 2**63 - 1
_TOKEN_ID_KEY = re.compile(r"[0-9]{1,20}")


class RequestOutputKind(enum.Enum):
    """What each RequestOutput of a request carries.

    CUMULATIVE: everything so far, every step. DELTA: only what is new since the previous output
    (streaming). FINAL_ONLY: a single output when the request finishes.
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


def _require(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{field} {message}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    """A finite int or float (bool and NaN excluded), so range checks cannot raise TypeError."""
    return _is_int(value) or (isinstance(value, float) and math.isfinite(value))


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
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: Optional[StructuredOutputsParams] = None  # or its fields as a dict

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, dict):
            object.__setattr__(
                self, "structured_outputs", StructuredOutputsParams(**self.structured_outputs)
            )
        _require(
            self.structured_outputs is None
            or isinstance(self.structured_outputs, StructuredOutputsParams),
            "structured_outputs",
            f"must be a StructuredOutputsParams or a dict, got {self.structured_outputs!r}",
        )
        # Normalise list inputs so the object stays immutable; reject shapes that cannot be.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is not None:
            _require(
                isinstance(self.stop, (list, tuple)),
                "stop",
                f"must be a string or a list of strings, got {self.stop!r}",
            )
            object.__setattr__(self, "stop", tuple(self.stop))
        _require(
            isinstance(self.stop_token_ids, (list, tuple)) or self.stop_token_ids is None,
            "stop_token_ids",
            f"must be a list of token ids, got {self.stop_token_ids!r}",
        )
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if self.logit_bias is not None:
            object.__setattr__(self, "logit_bias", self._normalised_logit_bias())
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        self._validate_sampling()
        if 0 < self.temperature < MIN_TEMPERATURE:
            logger.debug(
                "temperature %s is below %s, where float32 logits overflow; using %s",
                self.temperature,
                MIN_TEMPERATURE,
                MIN_TEMPERATURE,
            )
            object.__setattr__(self, "temperature", MIN_TEMPERATURE)
        self._validate_lengths_and_outputs()

    def _normalised_logit_bias(self) -> dict[int, float]:
        # JSON (the OpenAI API) sends token ids as strings: accept "123" as 123.
        _require(
            isinstance(self.logit_bias, dict),
            "logit_bias",
            f"must be a dict of token id -> bias, got {self.logit_bias!r}",
        )
        biases = {}
        for token_id, bias in self.logit_bias.items():
            ok = _is_int(token_id) or (
                isinstance(token_id, str) and _TOKEN_ID_KEY.fullmatch(token_id) is not None
            )
            _require(
                ok and int(token_id) >= 0,
                "logit_bias",
                f"keys must be token ids >= 0, got {token_id!r}",
            )
            _require(
                _is_real(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS,
                "logit_bias",
                f"values must be in [-100, 100], got {bias!r} for token {token_id}",
            )
            biases[int(token_id)] = float(bias)
        return biases

    def _validate_sampling(self) -> None:
        _require(
            _is_int(self.n) and 1 <= self.n <= MAX_N,
            "n",
            f"must be an integer in [1, {MAX_N}], got {self.n!r}",
        )
        _require(
            _is_real(self.temperature) and 0 <= self.temperature <= MAX_TEMPERATURE,
            "temperature",
            f"must be in [0, {MAX_TEMPERATURE:g}] (0 is greedy), got {self.temperature!r}",
        )
        _require(
            _is_real(self.top_p) and 0 < self.top_p <= 1,
            "top_p",
            f"must be in (0, 1], got {self.top_p!r}",
        )
        _require(
            _is_int(self.top_k) and 0 <= self.top_k <= MAX_TOP_K,
            "top_k",
            f"must be an integer in [1, {MAX_TOP_K}], or 0 or -1 to disable it, got {self.top_k!r}",
        )
        _require(
            _is_real(self.min_p) and 0 <= self.min_p <= 1,
            "min_p",
            f"must be in [0, 1], got {self.min_p!r}",
        )
        for field in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, field)
            _require(
                _is_real(value) and -MAX_PENALTY <= value <= MAX_PENALTY,
                field,
                f"must be in [-2, 2], got {value!r}",
            )
        _require(
            _is_real(self.repetition_penalty)
            and MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY,
            "repetition_penalty",
            f"must be in [{MIN_REPETITION_PENALTY}, {MAX_REPETITION_PENALTY:g}] (1 disables it), "
            f"got {self.repetition_penalty!r}",
        )
        _require(
            self.seed is None or (_is_int(self.seed) and SEED_MIN <= self.seed <= SEED_MAX),
            "seed",
            f"must be an integer in [{SEED_MIN}, {SEED_MAX}] or None, got {self.seed!r}",
        )

    def _validate_lengths_and_outputs(self) -> None:
        _require(
            self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
            "max_tokens",
            f"must be an integer >= 1 or None, got {self.max_tokens!r}",
        )
        _require(
            _is_int(self.min_tokens) and self.min_tokens >= 0,
            "min_tokens",
            f"must be an integer >= 0, got {self.min_tokens!r}",
        )
        _require(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}",
        )
        for field in ("logprobs", "prompt_logprobs"):
            value = getattr(self, field)
            _require(
                value is None or (_is_int(value) and 0 <= value <= MAX_LOGPROBS),
                field,
                f"must be an integer in [0, {MAX_LOGPROBS}] or None, got {value!r}",
            )
        _require(
            all(isinstance(s, str) and s for s in self.stop or ()),
            "stop",
            f"must be non-empty strings, got {self.stop!r}",
        )
        _require(
            all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            f"must be integers >= 0, got {list(self.stop_token_ids)!r}",
        )
        _require(
            isinstance(self.output_kind, RequestOutputKind),
            "output_kind",
            f"must be one of {[k.name for k in RequestOutputKind]}, got {self.output_kind!r}",
        )

    def for_vocabulary(
        self, vocab_size: int, eos_token_ids: Sequence[int] = ()
    ) -> "SamplingParams":
        """These params checked against a model's vocabulary (ValueError naming the field), with
        ``top_k`` beyond it turned off (top-k of more tokens than exist keeps them all)."""
        for field, token_ids in (
            ("logit_bias", self.logit_bias or ()),
            ("stop_token_ids", self.stop_token_ids),
        ):
            outside = [t for t in token_ids if not 0 <= t < vocab_size]
            if outside:
                raise ValueError(
                    f"{field} has token id {outside[0]} outside the vocabulary "
                    f"[0, {vocab_size}) of this model"
                )
        if self.min_tokens and len(self.stop_token_ids) >= vocab_size - len(eos_token_ids):
            banned = set(self.stop_token_ids) | (set() if self.ignore_eos else set(eos_token_ids))
            if len(banned) >= vocab_size:
                raise ValueError(
                    "stop_token_ids (with EOS) hold every token of the vocabulary, so none is "
                    "left to sample before min_tokens; drop min_tokens or some stop tokens"
                )
        return dataclasses.replace(self, top_k=0) if self.top_k > vocab_size else self

    @property
    def greedy(self) -> bool:
        """True when sampling is greedy (temperature 0)."""
        return self.temperature == 0.0


def needs_processing(params: SamplingParams) -> bool:
    """True when the params adjust logits before sampling: penalties, logit bias, min_tokens."""
    return bool(
        params.repetition_penalty != 1.0
        or params.frequency_penalty
        or params.presence_penalty
        or params.logit_bias
        or params.min_tokens
    )
