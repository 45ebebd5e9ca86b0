"""Request and response bodies of the OpenAI API shared by both endpoints, and /v1/completions.

Requests are parsed strictly (``"5"`` is not an integer, ``true`` is not a number) so that a
wrong type is a 400, not a guess; unknown fields are ignored, as OpenAI clients send extras.
"""

from __future__ import annotations

import time
from types import MappingProxyType
from typing import Annotated, Any, Literal, Mapping, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from octavo import sampling_params as sp
from octavo.sampling_defaults import cap_max_tokens
from octavo.sampling_params import RequestOutputKind, SamplingParams

NO_DEFAULTS: Mapping[str, Any] = MappingProxyType({})

# Fields whose name may start a SamplingParams ValueError, to fill the error's ``param``.
SAMPLING_FIELDS = frozenset(
    "n temperature top_p top_k min_p seed presence_penalty frequency_penalty repetition_penalty "
    "logit_bias stop stop_token_ids max_tokens min_tokens logprobs prompt_logprobs".split()
)


class RequestModel(BaseModel):
    """Base of request bodies: strict types, unknown fields ignored."""

    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(RequestModel):
    include_usage: bool = False


TokenId = Annotated[int, Field(ge=0)]
Penalty = Annotated[float, Field(ge=-sp.MAX_PENALTY, le=sp.MAX_PENALTY)]
LogitBias = Annotated[float, Field(ge=-sp.MAX_LOGIT_BIAS, le=sp.MAX_LOGIT_BIAS)]
NumLogprobs = Annotated[int, Field(ge=0, le=sp.MAX_LOGPROBS)]


class SamplingRequest(RequestModel):
    """Fields both /v1/completions and /v1/chat/completions take, OpenAI's and vLLM's extras.

    Each numeric field carries its bounds (``octavo.sampling_params``), so an out-of-range value
    is a 400 naming it, and /openapi.json publishes them. Token ids are also checked against the
    model's vocabulary when the request is admitted."""

    model: Optional[str] = None
    n: int = Field(1, ge=1, le=sp.MAX_N)
    temperature: Optional[float] = Field(None, ge=0, le=sp.MAX_TEMPERATURE)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    stop: Union[str, list[str], None] = None
    seed: Optional[int] = Field(None, ge=sp.SEED_MIN, le=sp.SEED_MAX)
    presence_penalty: Optional[Penalty] = None
    frequency_penalty: Optional[Penalty] = None
    logit_bias: Optional[dict[str, LogitBias]] = None
    user: Optional[str] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    # vLLM's extra body fields
    top_k: Optional[int] = Field(
        None, ge=-1, le=sp.MAX_TOP_K, description="-1 or 0: off; above the vocabulary: off"
    )
    min_p: Optional[float] = Field(None, ge=0, le=1)
    repetition_penalty: Optional[float] = Field(
        None, ge=sp.MIN_REPETITION_PENALTY, le=sp.MAX_REPETITION_PENALTY
    )
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: Optional[list[TokenId]] = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    cache_salt: Optional[str] = None
    priority: int = Field(0, ge=sp.PRIORITY_MIN, le=sp.PRIORITY_MAX)
    # output constraints (octavo.entrypoints.openai.structured): OpenAI's, vLLM's, and the
    # guided_* names vLLM had before structured_outputs
    response_format: Optional[dict[str, Any]] = None
    structured_outputs: Optional[dict[str, Any]] = None
    guided_json: Union[None, str, dict[str, Any]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None

    def sampling_params(
        self,
        max_tokens: Optional[int],
        logprobs: Optional[int],
        defaults: Mapping[str, Any] = NO_DEFAULTS,
    ) -> SamplingParams:
        """SamplingParams for this request; raises ValueError naming a bad field.

        ``defaults`` (the generation config's, see octavo.sampling_defaults) fill the fields the
        request leaves unset, and its ``max_tokens`` caps the output length."""

        def unset_gets_default(field: str, library_default: Any) -> Any:
            value = getattr(self, field)
            return defaults.get(field, library_default) if value is None else value

        return SamplingParams(
            n=self.n,
            temperature=unset_gets_default("temperature", 1.0),
            top_p=unset_gets_default("top_p", 1.0),
            top_k=unset_gets_default("top_k", 0),
            min_p=unset_gets_default("min_p", 0.0),
            seed=self.seed,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=unset_gets_default("repetition_penalty", 1.0),
            logit_bias=self.logit_bias,
            stop=self.stop or None,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            max_tokens=cap_max_tokens(max_tokens, defaults),
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
        )

    @property
    def include_usage(self) -> bool:
        """True when a stream should end with a usage chunk."""
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingRequest):
    """The body of POST /v1/completions."""

    prompt: Union[str, list[str], list[TokenId], list[list[TokenId]]]
    max_tokens: Optional[int] = Field(16, ge=1)
    echo: bool = False
    logprobs: Optional[NumLogprobs] = None
    suffix: Optional[str] = None
    best_of: Optional[int] = Field(None, ge=1, le=sp.MAX_N)


# --- responses ----------------------------------------------------------------------------------


class ResponseModel(BaseModel):
    """Base of response bodies."""


class UsageInfo(ResponseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class ModelCard(ResponseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "octavo"
    root: Optional[str] = None
    parent: Optional[str] = None  # a LoRA adapter's base model
    max_model_len: Optional[int] = None


class ModelList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class CompletionLogprobs(ResponseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)


class CompletionChoice(ResponseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None


class CompletionResponse(ResponseModel):
    id: str
    object: str = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Optional[UsageInfo] = None


def dump(model: BaseModel) -> dict[str, Any]:
    """A response model as a JSON-ready dict."""
    return model.model_dump(mode="json")


class TokenizeRequest(RequestModel):
    """The body of POST /tokenize: text, or chat messages rendered with the chat template."""

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[Any]] = None
    tools: Optional[list[Any]] = None  # with messages: shown to the chat template
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(RequestModel):
    """The body of POST /detokenize."""

    model: Optional[str] = None
    tokens: list[TokenId]


class LoadLoRAAdapterRequest(RequestModel):
    """The body of POST /v1/load_lora_adapter (vLLM's)."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(RequestModel):
    """The body of POST /v1/unload_lora_adapter (vLLM's; ``lora_int_id`` is accepted and
    must match the adapter's when given)."""

    lora_name: str = Field(min_length=1)
    lora_int_id: Optional[int] = None
