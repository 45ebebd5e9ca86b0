"""What a tool parser is: it knows one model family's tool-call format, both ways. It builds the
structural tag that constrains the model's output to that format (so a call's arguments always
parse), and it reads the model's text back into content and calls, from any prefix of that
text: streams are computed by re-parsing the text so far."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Literal, Optional, Protocol, Sequence

ToolChoiceMode = Literal["auto", "required", "named"]
"""How the output is constrained (``tool_choice`` ``none`` constrains nothing and parses
nothing): free text with calls wherever the model opens one; calls only, at least one; exactly one
call of the one tool given."""

JsonContent = Callable[[dict[str, Any]], dict[str, Any]]
"""A JSON schema -> the structural-tag format of a JSON value matching it (the grammar backend's,
so that tool arguments follow the engine's JSON rules: its whitespace setting among them)."""


@dataclasses.dataclass(frozen=True)
class ParsedCall:
    """One tool call as far as the text goes. ``name`` is None until the whole name has been
    read (a call without a name is not reported); ``arguments`` is the arguments' JSON text so
    far; ``finished``: the call's closing marker was read."""

    name: Optional[str]
    arguments: str
    finished: bool


@dataclasses.dataclass(frozen=True)
class ParsedMessage:
    """A model's text as content and tool calls. For any prefix of a text, each field of its
    parse is a prefix of the same field of the whole text's parse (``content``, each call's
    ``arguments``), and calls are only ever added: what a stream sends never has to be taken
    back, and its deltas add up to the message."""

    content: str
    calls: tuple[ParsedCall, ...]

    @property
    def named_calls(self) -> tuple[ParsedCall, ...]:
        """The calls to report (those whose name has been read), in order."""
        return tuple(call for call in self.calls if call.name is not None)


class ToolParser(Protocol):
    """A model family's tool-call format. Plugins offer parsers through the
    ``octavo_tool_parsers`` hook; ``octavo serve --tool-call-parser NAME`` picks one."""

    def structural_tag(
        self,
        tools: Sequence[dict[str, Any]],
        mode: ToolChoiceMode,
        parallel_tool_calls: bool,
        json_content: JsonContent,
    ) -> dict[str, Any]:
        """xgrammar's structural tag (``{"type": "structural_tag", "format": ...}``) for
        ``tools`` (OpenAI's ``{"type": "function", "function": {...}}`` entries, already
        checked) under ``mode``; for ``named``, ``tools`` holds the one tool."""

    def parse(self, text: str, final: bool) -> ParsedMessage:
        """``text`` (all the model's output so far) as content and calls. ``final``: the output
        has ended, so nothing is held back for what might come next."""


def longest_suffix_in(text: str, candidates: Sequence[str]) -> int:
    """The length of the longest suffix of ``text`` that is a prefix of one of ``candidates``
    (what a stream holds back: it might be the start of a marker)."""
    best = 0
    for candidate in candidates:
        for length in range(min(len(text), len(candidate)), best, -1):
            if candidate.startswith(text[len(text) - length :]):
                best = length
                break
    return best
