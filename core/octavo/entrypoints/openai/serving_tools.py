"""A chat request's ``tools`` and ``tool_choice``, as OpenAI and vLLM have them: which output
constraint they put on the model (through the server's tool parser's structural tag), and how
the output is read back into content and ``tool_calls``.

``none`` (or no tools): free text, nothing parsed, so never a call. ``required``: calls only, at
least one, each to one of the tools with arguments matching its schema. A named function: that
one call. ``auto`` (OpenAI's default when tools are given): free text, and once the model opens
a call it is constrained like the others; as in vLLM it needs ``--enable-auto-tool-choice``."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from octavo.entrypoints.openai.chat_protocol import (
    ChatCompletionRequest,
    NamedToolChoice,
    ToolCall,
    ToolCallFunction,
)
from octavo.entrypoints.openai.errors import bad_request
from octavo.structured_output import StructuredOutputsParams
from octavo.structured_output.backend import json_grammar
from octavo.tool_parsers import ParsedMessage, ToolParser, new_tool_call_id


@dataclasses.dataclass(frozen=True)
class ToolCalling:
    """How one chat request's output is constrained and read. ``parser`` None: plain content."""

    parser: Optional[ToolParser] = None
    constraint: Optional[StructuredOutputsParams] = None

    def parse(self, text: str, final: bool) -> ParsedMessage:
        assert self.parser is not None
        return self.parser.parse(text, final)

    def message(self, text: str) -> tuple[Optional[str], list[ToolCall]]:
        """A finished output's ``(content, tool_calls)``."""
        if self.parser is None:
            return text, []
        parsed = self.parse(text, final=True)
        calls = [
            ToolCall(
                id=new_tool_call_id(),
                function=ToolCallFunction(name=call.name, arguments=call.arguments),
            )
            for call in parsed.named_calls
        ]
        return parsed.content or (None if calls else ""), calls


def finish_reason(reason: Optional[str], made_calls: bool) -> Optional[str]:
    """OpenAI's ``tool_calls`` for an output that ended on its own after calling tools."""
    return "tool_calls" if made_calls and reason == "stop" else reason


def tool_calling(
    body: ChatCompletionRequest,
    parser: Optional[ToolParser],
    enable_auto_tool_choice: bool,
    any_whitespace: bool,
) -> ToolCalling:
    """The request's tool calling, or a 400 naming ``tools`` or ``tool_choice``."""
    if body.tools is None:
        if body.tool_choice is not None and body.tool_choice != "none":
            raise bad_request("tool_choice needs tools to choose from", param="tool_choice")
        return ToolCalling()
    if not body.tools:
        raise bad_request(
            "tools must hold at least one tool; leave the field out for none", param="tools"
        )
    tools = body.tool_dicts()
    names = [tool["function"]["name"] for tool in tools]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise bad_request(f"tools name {', '.join(repeated)} more than once", param="tools")
    choice = "auto" if body.tool_choice is None else body.tool_choice
    if choice == "none":
        return ToolCalling()
    if parser is None:
        raise bad_request(
            "this server reads no tool calls; start it with --tool-call-parser NAME "
            '(or send tool_choice "none")',
            param="tool_choice",
        )
    if choice == "auto" and not enable_auto_tool_choice:
        raise bad_request(
            'tool_choice "auto" (the default when tools are given) needs the server started '
            'with --enable-auto-tool-choice; or send tool_choice "required", "none" or '
            '{"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise bad_request(
                f"tool_choice names {choice.function.name!r}, which is not in tools "
                f"({', '.join(names)})",
                param="tool_choice",
            )
        tools = [tools[names.index(choice.function.name)]]
        mode = "named"
    else:
        mode = choice
    tag = parser.structural_tag(
        tools, mode, body.parallel_tool_calls, _json_content(tools, any_whitespace)
    )
    return ToolCalling(parser, StructuredOutputsParams(structural_tag=tag))


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or {"type": "object"}


def _json_content(tools: list[dict[str, Any]], any_whitespace: bool):
    """The parsers' ``json_content``: a tool's schema as a grammar, or a 400 naming the tool."""

    def json_content(schema: dict[str, Any]) -> dict[str, Any]:
        names = [t["function"]["name"] for t in tools if _parameters(t) == schema]
        try:
            return {"type": "grammar", "grammar": json_grammar(schema, any_whitespace)}
        except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError, ValueError, ...
            detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise bad_request(
                f"tools: the parameters of {names[0] if names else 'a tool'!r} cannot be "
                f"compiled to a grammar: {detail}",
                param="tools",
            ) from None

    return json_content
