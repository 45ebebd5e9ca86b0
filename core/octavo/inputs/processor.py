"""InputProcessor: a prompt, its SamplingParams and options to a ``ProcessedRequest``, once."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Optional, Sequence, Union

from octavo.inputs.data import (
    ProcessedPrompt,
    ProcessedRequest,
    PromptError,
    PromptType,
    RequestOptions,
)
from octavo.sampling_params import SamplingParams


class InputProcessor:
    """Tokenises and validates requests for one model.

    ``tokenizer`` encodes text prompts (None: token-id prompts only); ``vocab_size`` bounds
    token ids; ``max_model_len`` bounds the prompt (at least one output token must fit);
    ``eos_token_ids`` are the model's end tokens (see ``SamplingParams.for_vocabulary``).
    Every check raises a ValueError whose message names the field at fault (``PromptError``
    for the prompt), which the server turns into its 400.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        max_model_len: int,
        eos_token_ids: Sequence[int] = (),
        grammar_backend: Optional[Callable[[], Any]] = None,
    ) -> None:
        """``grammar_backend()`` gives the GrammarBackend that compiles a request's
        ``structured_outputs`` (None: such requests are refused)."""
        self.grammar_backend = grammar_backend
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = tuple(eos_token_ids)

    def process(
        self,
        request_id: str,
        prompt: Union[PromptType, ProcessedPrompt],
        params: SamplingParams,
        options: Optional[RequestOptions] = None,
    ) -> ProcessedRequest:
        """``prompt`` tokenised (once) and every part of the request checked. A
        ``ProcessedPrompt`` (from ``process_prompt``) is taken as already checked."""
        options = RequestOptions() if options is None else options
        if not isinstance(prompt, ProcessedPrompt):
            options = _with_prompt_salt(options, prompt)
            prompt = self.process_prompt(prompt)
        params = self.fit_params(params)
        if options.arrival_time is None:
            options = dataclasses.replace(options, arrival_time=time.time())
        return ProcessedRequest(request_id, prompt, params, options)

    def process_prompt(self, prompt: PromptType, field: str = "prompt") -> ProcessedPrompt:
        """``prompt`` tokenised and checked (``field`` names it in errors)."""
        processed = self.tokenize(prompt)
        self.check_prompt(processed.token_ids, field)
        return processed

    def fit_params(self, params: SamplingParams) -> SamplingParams:
        """``params`` checked against this model (``SamplingParams.for_vocabulary``) and against
        what this engine can do."""
        if params.prompt_logprobs is not None:
            raise ValueError(
                "prompt_logprobs is not supported yet: this engine does not compute logprobs of "
                "prompt tokens; leave it unset"
            )
        if params.stop and self.tokenizer is None:
            raise ValueError(
                "stop strings need a tokenizer; this engine runs without one (use stop_token_ids)"
            )
        if params.structured_outputs is not None:
            if self.grammar_backend is None:
                raise ValueError(
                    "structured_outputs needs a tokenizer; this engine runs without one"
                )
            self.grammar_backend().compile(params.structured_outputs)  # a bad one fails here
        return params.for_vocabulary(self.vocab_size, self.eos_token_ids)

    def tokenize(self, prompt: PromptType) -> ProcessedPrompt:
        """``prompt`` as token ids: text is encoded here (once), token ids are taken as given."""
        text = None
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                text, prompt = prompt.get("prompt"), prompt["prompt_token_ids"]
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise PromptError(
                    "prompt must have 'prompt' (text) or 'prompt_token_ids'; "
                    f"got a dict with keys {sorted(prompt)}"
                )
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise PromptError("prompt is text but this engine has no tokenizer; give token ids")
            token_ids = self.tokenizer.encode(prompt) if prompt else []
            return ProcessedPrompt(tuple(token_ids), prompt)
        if isinstance(prompt, (list, tuple)) and all(_is_token_id(t) for t in prompt):
            return ProcessedPrompt(tuple(prompt), text)
        raise PromptError(
            "prompt must be text, a list of token ids, or a dict with 'prompt' or "
            f"'prompt_token_ids'; got {type(prompt).__name__}"
        )

    def check_prompt(self, token_ids: Sequence[int], field: str = "prompt") -> None:
        """The prompt is not empty, its ids are in the vocabulary, and it leaves room for output."""
        if not token_ids:
            raise PromptError(f"{field} is empty; give at least one token")
        self.check_token_ids(token_ids, field)
        if len(token_ids) >= self.max_model_len:
            raise PromptError(
                f"{field} has {len(token_ids)} tokens, which leaves no room to generate within "
                f"max_model_len={self.max_model_len} (the model's context, counting at least one "
                "output token); shorten it",
                code="context_length_exceeded",
            )

    def check_token_ids(self, token_ids: Sequence[int], field: str = "prompt") -> None:
        """Every id is in this model's vocabulary."""
        if token_ids and (min(token_ids) < 0 or max(token_ids) >= self.vocab_size):
            raise PromptError(f"{field} token ids must be in [0, {self.vocab_size}) for this model")


def _with_prompt_salt(options: RequestOptions, prompt: PromptType) -> RequestOptions:
    """``options`` with the prompt dict's ``cache_salt``, which must agree with the option's."""
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    if salt is None or salt == options.cache_salt:
        return options
    if options.cache_salt is not None:
        raise ValueError(
            f"cache_salt is given twice with different values ({salt!r} in the prompt, "
            f"{options.cache_salt!r} as an option); give it once"
        )
    return dataclasses.replace(options, cache_salt=salt)


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
