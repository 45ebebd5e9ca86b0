"""Request and response bodies of POST /v1/chat/completions."""

from __future__ import annotations

import time
from typing import Any, Literal, Optional, Union

from pydantic import Field

from octavo.entrypoints.openai.protocol import (
    NumLogprobs,
    RequestModel,
    ResponseModel,
    SamplingRequest,
    UsageInfo,
)

ROLES = ("system", "developer", "user", "assistant")


class TextContentPart(RequestModel):
    type: str
    text: Optional[str] = None


class ChatMessage(RequestModel):
    """One message; ``content`` is text or a list of ``{"type": "text", "text": ...}`` parts."""

    role: str
    content: Union[str, list[TextContentPart], None] = None
    name: Optional[str] = None

    def text(self) -> str:
        """The message's text; raises ValueError for roles and parts this server cannot render."""
        if self.role not in ROLES:
            raise ValueError(f"role {self.role!r} is not supported; use one of {', '.join(ROLES)}")
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise ValueError(
                    f"content parts of type {part.type!r} are not supported; send text parts"
                )
            parts.append(part.text)
        return "".join(parts)


class ChatCompletionRequest(SamplingRequest):
    """The body of POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    max_tokens: Optional[int] = Field(None, ge=1)  # deprecated by OpenAI for max_completion_tokens
    logprobs: bool = False
    top_logprobs: Optional[NumLogprobs] = None
    tools: Optional[list[dict[str, Any]]] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Optional[dict[str, Any]] = None

    def conversation(self) -> list[dict[str, str]]:
        """The messages as ``{"role", "content"}`` dicts for a chat template
        (developer -> system)."""
        if not self.messages:
            raise ValueError("messages must contain at least one message")
        return [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            for m in self.messages
        ]

    def num_logprobs(self) -> Optional[int]:
        """How many top alternatives per token to return (None: no logprobs)."""
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        return (self.top_logprobs or 0) if self.logprobs else None


class ChatLogprobEntry(ResponseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatLogprobToken(ChatLogprobEntry):
    top_logprobs: list[ChatLogprobEntry] = Field(default_factory=list)


class ChatLogprobs(ResponseModel):
    content: list[ChatLogprobToken] = Field(default_factory=list)


class ChatResponseMessage(ResponseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(ResponseModel):
    index: int
    message: ChatResponseMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None


class ChatCompletionResponse(ResponseModel):
    id: str
    object: str = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
