"""The input side: the prompt shapes a request may take (``data``) and the one processor that
turns a prompt, its SamplingParams and its options into a ``ProcessedRequest`` (``processor``):
tokenised once and validated once, for the offline API and the server alike."""

from octavo.inputs.data import (
    ProcessedPrompt,
    ProcessedRequest,
    PromptError,
    PromptType,
    RequestOptions,
    TextPrompt,
    TokensPrompt,
)
from octavo.inputs.processor import InputProcessor

__all__ = [
    "InputProcessor",
    "ProcessedPrompt",
    "ProcessedRequest",
    "PromptError",
    "PromptType",
    "RequestOptions",
    "TextPrompt",
    "TokensPrompt",
]
