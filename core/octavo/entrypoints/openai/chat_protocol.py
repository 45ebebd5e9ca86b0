"""Request and response bodies of POST /v1/chat/completions."""

from __future__ import annotations

import json
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

ROLES = ("system", "developer", "user", "assistant", "tool")
TOOL_NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for function names


class TextContentPart(RequestModel):
    type: str
    text: Optional[str] = None


class FunctionCall(RequestModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class MessageToolCall(RequestModel):
    """A call an earlier assistant message made."""

    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(RequestModel):
    """One message; ``content`` is text or a list of ``{"type": "text", "text": ...}`` parts;
    an assistant's may carry ``tool_calls``, a ``tool`` message answers one by
    ``tool_call_id``."""

    role: str
    content: Union[str, list[TextContentPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[list[MessageToolCall]] = None
    tool_call_id: Optional[str] = None

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

    def for_template(self) -> dict[str, Any]:
        """The message as a chat template takes it: ``role`` (developer -> system) and
        ``content``; an assistant's calls with their arguments as objects (templates write
        them with ``tojson``), a tool message's ``tool_call_id``."""
        message: dict[str, Any] = {
            "role": "system" if self.role == "developer" else self.role,
            "content": self.text(),
        }
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"only assistant messages carry tool_calls, not {self.role!r} ones")
        if self.tool_calls:
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {
                        "name": call.function.name,
                        "arguments": _arguments(call.function),
                    },
                }
                for call in self.tool_calls
            ]
        if self.role == "tool":
            if self.tool_call_id is None:
                raise ValueError("a tool message needs the tool_call_id of the call it answers")
            message["tool_call_id"] = self.tool_call_id
        return message


def _arguments(function: FunctionCall) -> Any:
    try:
        return json.loads(function.arguments)
    except ValueError:
        raise ValueError(
            f"the arguments of the call to {function.name!r} are not JSON: "
            f"{function.arguments[:80]!r}"
        ) from None


class FunctionDefinition(RequestModel):
    name: str = Field(pattern=TOOL_NAME_PATTERN)
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None  # a JSON schema; absent: any JSON object
    strict: Optional[bool] = None


class ChatCompletionTool(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    """``{"type": "function", "function": {"name": ...}}``: call exactly this tool."""

    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    """The body of POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    max_tokens: Optional[int] = Field(None, ge=1)  # deprecated by OpenAI for max_completion_tokens
    logprobs: bool = False
    top_logprobs: Optional[NumLogprobs] = None
    tools: Optional[list[ChatCompletionTool]] = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Optional[dict[str, Any]] = None

    def conversation(self) -> list[dict[str, Any]]:
        """The messages as a chat template takes them (``ChatMessage.for_template``)."""
        if not self.messages:
            raise ValueError("messages must contain at least one message")
        conversation = []
        for index, message in enumerate(self.messages):
            try:
                conversation.append(message.for_template())
            except ValueError as exc:
                raise ValueError(f"messages entry {index}: {exc}") from None
        return conversation

    def template_kwargs(self) -> dict[str, Any]:
        """What the chat template takes beside the messages: ``chat_template_kwargs``, and the
        tools as OpenAI's dicts (rendered whatever ``tool_choice`` says: with ``none`` the model
        still sees them, as in OpenAI and vLLM)."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.tools:
            kwargs["tools"] = self.tool_dicts()
        return kwargs

    def tool_dicts(self) -> list[dict[str, Any]]:
        return [tool.model_dump(exclude_none=True) for tool in self.tools or ()]

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


class ToolCallFunction(ResponseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(ResponseModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatResponseMessage(ResponseModel):
    role: Literal["assistant"] = "assistant"
    content: Optional[str]  # None: a message of tool calls only
    tool_calls: list[ToolCall] = Field(default_factory=list)


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
