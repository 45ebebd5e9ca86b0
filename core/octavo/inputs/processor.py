"""InputProcessor: a prompt, its SamplingParams and options to a ``ProcessedRequest``, once."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Optional, Sequence

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
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = tuple(eos_token_ids)

    def process(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        options: Optional[RequestOptions] = None,
    ) -> ProcessedRequest:
        """``prompt`` tokenised (once) and every part of the request checked."""
        options = RequestOptions() if options is None else options
        processed = self.tokenize(prompt)
        self.check_prompt(processed.token_ids)
        params = params.for_vocabulary(self.vocab_size, self.eos_token_ids)
        salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        if salt is not None and options.cache_salt is None:
            options = dataclasses.replace(options, cache_salt=salt)
        if options.arrival_time is None:
            options = dataclasses.replace(options, arrival_time=time.time())
        return ProcessedRequest(request_id, processed, params, options)

    def tokenize(self, prompt: PromptType) -> ProcessedPrompt:
        """``prompt`` as token ids (text is encoded here, the only place the engine encodes)."""
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
            return ProcessedPrompt(self.tokenizer.encode(prompt) if prompt else [], prompt)
        if isinstance(prompt, (list, tuple)) and all(_is_token_id(t) for t in prompt):
            return ProcessedPrompt(list(prompt), text)
        raise PromptError(
            "prompt must be text, a list of token ids, or a dict with 'prompt' or "
            f"'prompt_token_ids'; got {type(prompt).__name__}"
        )

    def check_prompt(self, token_ids: Sequence[int]) -> None:
        """The prompt is not empty, its ids are in the vocabulary, and it leaves room for output."""
        if not token_ids:
            raise PromptError("prompt is empty; give at least one token")
        if min(token_ids) < 0 or max(token_ids) >= self.vocab_size:
            raise PromptError(f"prompt token ids must be in [0, {self.vocab_size}) for this model")
        if len(token_ids) >= self.max_model_len:
            raise PromptError(
                f"prompt has {len(token_ids)} tokens, which leaves no room to generate within "
                f"max_model_len={self.max_model_len} (the model's context, counting at least one "
                "output token); shorten it",
                code="context_length_exceeded",
            )


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
