"""The Hermes tool-call format (Hermes, Qwen 2.5 and 3, the demo model's template): each call is
``<tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>``; the message's content is
the text before the first call (text between and after calls is not part of the message, as in
vLLM's Hermes parser)."""

from __future__ import annotations

import json
import re
from typing import Any, Optional, Sequence

from octavo.tool_parsers.base import (
    JsonContent,
    ParsedCall,
    ParsedMessage,
    ToolChoiceMode,
    longest_suffix_in,
)

CALL_START = "<tool_call>"
CALL_END = "</tool_call>"
_TAG_BEGIN = '<tool_call>\n{"name": "%s", "arguments": '
_TAG_END = "}\n</tool_call>"
# A call's body as the format writes it, up to where its arguments start.
_CANONICAL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([^"\\]*)"\s*,\s*"arguments"\s*:\s*')
# What follows a call's arguments in its body: whitespace, the object's closing brace.
_CLOSING = re.compile(r"\s*(\}\s*)?$")


class HermesToolParser:
    """``--tool-call-parser hermes``."""

    def structural_tag(
        self,
        tools: Sequence[dict[str, Any]],
        mode: ToolChoiceMode,
        parallel_tool_calls: bool,
        json_content: JsonContent,
    ) -> dict[str, Any]:
        tags = [_tag(tool["function"], json_content) for tool in tools]
        if mode == "named":
            (fmt,) = tags
        elif mode == "required":
            fmt = {
                "type": "tags_with_separator",
                "tags": tags,
                "separator": "\n",
                "at_least_one": True,
                "stop_after_first": not parallel_tool_calls,
            }
        else:
            fmt = {
                "type": "triggered_tags",
                "triggers": [CALL_START],
                "tags": tags,
                "stop_after_first": not parallel_tool_calls,
            }
        return {"type": "structural_tag", "format": fmt}

    def parse(self, text: str, final: bool) -> ParsedMessage:
        start = text.find(CALL_START)
        if start < 0:
            held = 0 if final else longest_suffix_in(text, (CALL_START,))
            return ParsedMessage(text[: len(text) - held], ())
        calls = []
        while start >= 0:
            body_start = start + len(CALL_START)
            end = text.find(CALL_END, body_start)
            if end < 0:
                calls.append(_unfinished_call(text[body_start:]))
                break
            call = _finished_call(text[body_start:end])
            if call is not None:
                calls.append(call)
            start = text.find(CALL_START, end + len(CALL_END))
        return ParsedMessage(text[: text.find(CALL_START)], tuple(calls))


def _tag(function: dict[str, Any], json_content: JsonContent) -> dict[str, Any]:
    parameters = function.get("parameters") or {"type": "object"}
    return {
        "type": "tag",
        "begin": _TAG_BEGIN % function["name"],
        "content": json_content(parameters),
        "end": _TAG_END,
    }


def _unfinished_call(body: str) -> ParsedCall:
    """A call whose closing marker has not come (yet, or ever: cut by ``max_tokens``): its name
    once read, its arguments so far, less what may be its ending rather than its arguments
    (trailing whitespace, the object's closing brace, a prefix of ``</tool_call>``)."""
    head = _CANONICAL_HEAD.match(body)
    if head is None:
        return ParsedCall(None, "", False)
    arguments = body[head.end() :]
    arguments = arguments[: len(arguments) - longest_suffix_in(arguments, (CALL_END,))]
    return ParsedCall(head.group(1), _without_closing(arguments), False)


def _without_closing(arguments: str) -> str:
    closing = _CLOSING.search(arguments)
    return arguments[: closing.start()] if closing else arguments


def _finished_call(body: str) -> Optional[ParsedCall]:
    """A whole call: its arguments as the model wrote them when the body has the format's
    shape; else, when it is JSON with a name, its arguments re-serialised; else None (not a
    call)."""
    head = _CANONICAL_HEAD.match(body)
    if head is not None:
        return ParsedCall(head.group(1), _without_closing(body[head.end() :]), True)
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return ParsedCall(value["name"], json.dumps(arguments, ensure_ascii=False), True)
