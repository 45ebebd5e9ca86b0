"""The Hermes tool parser against the format, and the stream of tool-call deltas against the
parse of the whole text: whatever the chunking (any split of the text, so multi-token deltas
too), a stream adds up to the non-streamed message, and no delta is ever taken back."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from octavo.platform.facade import PlatformError, _merged
from octavo.tool_parsers import ParsedMessage, ToolCallStream
from octavo.tool_parsers.hermes import HermesToolParser

PARSER = HermesToolParser()


def _call(name: str, arguments: str, end: str = "}\n</tool_call>") -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}{end}'


def _calls(parsed: ParsedMessage) -> list[tuple[str, str]]:
    return [(call.name, call.arguments) for call in parsed.named_calls]


def test_text_without_calls_is_content():
    parsed = PARSER.parse("def f(x):\n    return x <= 1", final=True)
    assert parsed.content == "def f(x):\n    return x <= 1" and parsed.calls == ()


def test_calls_keep_their_arguments_as_written_and_content_is_the_text_before():
    text = "Checking.\n" + _call("add", '{"a": 1, "b": {"c": [2]}}') + "\n" + _call("f", "{}")
    parsed = PARSER.parse(text, final=True)
    assert parsed.content == "Checking.\n"
    assert _calls(parsed) == [("add", '{"a": 1, "b": {"c": [2]}}'), ("f", "{}")]
    assert all(call.finished for call in parsed.calls)


def test_a_call_in_another_key_order_is_read_as_json():
    text = '<tool_call>{"arguments": {"a": 1}, "name": "add"}</tool_call>'
    assert _calls(PARSER.parse(text, final=True)) == [("add", '{"a": 1}')]


def test_a_body_that_is_no_call_is_dropped():
    assert PARSER.parse("<tool_call>not json</tool_call>", final=True).named_calls == ()


def test_an_unfinished_call_reports_its_arguments_without_what_may_be_its_ending():
    """Cut by max_tokens inside the closing marker, the arguments are whole."""
    text = _call("get", '{"city": "Paris"}', end="}\n</tool_ca")
    (call,) = PARSER.parse(text, final=True).calls
    assert (call.name, call.arguments, call.finished) == ("get", '{"city": "Paris"}', False)


def test_a_partial_marker_is_held_back_from_content_until_the_end():
    assert PARSER.parse("x <tool_c", final=False).content == "x "
    assert PARSER.parse("x <tool_c", final=True).content == "x <tool_c"
    assert PARSER.parse("x <tool_z", final=False).content == "x <tool_z"


def test_the_structural_tag_has_the_formats_markers_per_mode():
    tools = [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
        {"type": "function", "function": {"name": "g"}},
    ]
    seen = []

    def content(schema):
        seen.append(schema)
        return {"type": "grammar", "grammar": 'root ::= "{}"'}

    auto = PARSER.structural_tag(tools, "auto", True, content)["format"]
    assert auto["type"] == "triggered_tags" and auto["triggers"] == ["<tool_call>"]
    assert [tag["begin"] for tag in auto["tags"]] == [
        '<tool_call>\n{"name": "f", "arguments": ',
        '<tool_call>\n{"name": "g", "arguments": ',
    ]
    assert seen == [{"type": "object"}, {"type": "object"}]  # no parameters: any object
    required = PARSER.structural_tag(tools, "required", False, content)["format"]
    assert required["at_least_one"] and required["stop_after_first"]
    named = PARSER.structural_tag(tools[:1], "named", True, content)["format"]
    assert named["type"] == "tag" and named["end"] == "}\n</tool_call>"


def _stream(text: str, cuts: list[int]) -> tuple[str, list[tuple[str, str]], int]:
    """The content and calls a stream of ``text`` cut at ``cuts`` sends, and its ids."""
    stream, content, calls, ids = ToolCallStream(), "", {}, set()
    bounds = sorted({0, *cuts, len(text)})
    for end in bounds[1:]:
        parsed = PARSER.parse(text[:end], final=end == len(text))
        content_delta, deltas = stream.update(parsed)
        content += content_delta
        for delta in deltas:
            if "id" in delta:
                assert delta["index"] not in calls and delta["type"] == "function"
                ids.add(delta["id"])
                calls[delta["index"]] = [delta["function"]["name"], ""]
            calls[delta["index"]][1] += delta["function"]["arguments"]
    return content, [tuple(calls[i]) for i in sorted(calls)], len(ids)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-99, 99) | st.text('ab}{<>"\\\n /', max_size=6),
    lambda children: (
        st.lists(children, max_size=3)
        | st.dictionaries(st.text("abc}", max_size=3), children, max_size=3)
    ),
    max_leaves=6,
)
TEXT = st.text("ab <>/{}\n_tolcal", max_size=12)


@st.composite
def messages(draw) -> str:
    """Content, then calls (in the format, with other whitespace, or cut short), and text
    between them."""
    text = draw(TEXT)
    for _ in range(draw(st.integers(0, 3))):
        arguments = draw(st.dictionaries(st.text("ab}", max_size=3), JSON, max_size=3))
        separators = draw(st.sampled_from([(", ", ": "), (",", ":")]))
        name = draw(st.sampled_from(["add", "get_weather", "f-1"]))
        end = draw(st.sampled_from(["}\n</tool_call>", "} </tool_call>", "}</tool_call>"]))
        text += _call(name, json.dumps(arguments, separators=separators), end) + draw(TEXT)
    if draw(st.booleans()):
        text = text[: draw(st.integers(0, len(text)))]  # cut by max_tokens
    return text


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_any_chunking_of_a_stream_adds_up_to_the_message(data):
    text = data.draw(messages())
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=len(text)))
    final = PARSER.parse(text, final=True)
    content, calls, num_ids = _stream(text, cuts)
    assert content == final.content
    assert calls == _calls(final)
    assert num_ids == len(calls)


@settings(max_examples=100, deadline=None)
@given(arguments=st.dictionaries(st.text("ab}", max_size=3), JSON, max_size=4))
def test_finished_calls_give_back_the_arguments_written(arguments):
    written = json.dumps(arguments)
    (call,) = PARSER.parse(_call("f", written), final=True).calls
    assert call.arguments == written and json.loads(call.arguments) == arguments


def test_a_stream_that_a_parser_takes_back_is_an_error():
    stream = ToolCallStream()
    stream.update(ParsedMessage("abc", ()))
    with pytest.raises(RuntimeError, match="took back content"):
        stream.update(ParsedMessage("abd", ()))


def test_the_core_offers_hermes_and_a_name_offered_twice_is_an_error():
    from octavo.platform import Platform

    assert Platform.select("cpu").tool_parsers()["hermes"] is HermesToolParser
    with pytest.raises(PlatformError, match="tool parser 'hermes' is provided by two plugins"):
        _merged([{"hermes": HermesToolParser}, {"hermes": ToolCallStream}], "tool parser")
