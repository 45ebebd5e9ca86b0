"""A streamed message with tool calls, as OpenAI's chunk deltas: each update re-parses the whole
text so far and sends what it adds (content, then per call its ``index``, ``id``, ``type`` and
name once, then argument fragments). Whatever the chunking, the deltas add up to the parse of
the whole text."""

from __future__ import annotations

import uuid
from typing import Any

from octavo.tool_parsers.base import ParsedMessage


def new_tool_call_id() -> str:
    """A fresh tool-call ``id``."""
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallStream:
    """What one choice's stream has sent so far."""

    def __init__(self) -> None:
        self._content = ""
        self._arguments: list[str] = []  # per call sent, its arguments so far

    def update(self, parsed: ParsedMessage) -> tuple[str, list[dict[str, Any]]]:
        """``(content delta, tool-call deltas)`` from the parse of the text so far to the
        previous one. A parse that does not extend the previous one (a parser breaking its
        contract) is a RuntimeError, not a stream that silently disagrees with its message."""
        content_delta = _extension(self._content, parsed.content, "content")
        self._content = parsed.content
        deltas = []
        for index, call in enumerate(parsed.named_calls):
            if index == len(self._arguments):
                self._arguments.append("")
                delta: dict[str, Any] = {
                    "index": index,
                    "id": new_tool_call_id(),
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
            else:
                fragment = _extension(self._arguments[index], call.arguments, "arguments")
                if not fragment:
                    continue
                delta = {"index": index, "function": {"arguments": fragment}}
            self._arguments[index] = call.arguments
            deltas.append(delta)
        return content_delta, deltas


def _extension(sent: str, now: str, what: str) -> str:
    if not now.startswith(sent):
        raise RuntimeError(f"the tool parser took back {what} it had given: {sent!r} -> {now!r}")
    return now[len(sent) :]
