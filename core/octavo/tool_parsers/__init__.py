"""Tool calling: parsers of model families' tool-call formats (plugins, through the
``octavo_tool_parsers`` hook), each building the structural tag that constrains the format and
reading text back into calls; and the stream of OpenAI tool-call deltas."""

from octavo.tool_parsers.base import ParsedCall, ParsedMessage, ToolChoiceMode, ToolParser
from octavo.tool_parsers.stream import ToolCallStream, new_tool_call_id

__all__ = [
    "ParsedCall",
    "ParsedMessage",
    "ToolCallStream",
    "ToolChoiceMode",
    "ToolParser",
    "new_tool_call_id",
]
