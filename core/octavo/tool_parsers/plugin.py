"""Registers the core's tool parsers through the same hook a tool-parser plugin uses."""

from __future__ import annotations

from octavo.platform import hookimpl


@hookimpl
def octavo_tool_parsers():
    """Hermes (``<tool_call>{...}</tool_call>``): Hermes, Qwen 2.5 and 3, the demo model."""
    from octavo.tool_parsers.hermes import HermesToolParser

    return {"hermes": HermesToolParser}
