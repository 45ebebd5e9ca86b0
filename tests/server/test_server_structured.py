"""Structured output over HTTP with the official client: response_format json_schema and
json_object, vLLM's structured_outputs, the old guided_* names as aliases, streams equal to
non-streamed outputs, and a table of bad constraints answered 400 with the server healthy."""

from __future__ import annotations

import json
import re

import httpx2 as httpx
import jsonschema
import pytest

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
}
MESSAGES = [{"role": "user", "content": "once upon a time"}]


def test_chat_response_format_json_schema_validates(server):
    client = server.client()
    response = client.chat.completions.create(
        model="tiny-llama",
        messages=MESSAGES,
        max_completion_tokens=96,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}},
    )
    choice = response.choices[0]
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    assert choice.finish_reason == "stop"


def test_json_object_and_vllms_structured_outputs(server):
    client = server.client()
    response = client.chat.completions.create(
        model="tiny-llama",
        messages=MESSAGES,
        max_completion_tokens=64,
        temperature=0,
        response_format={"type": "json_object"},
    )
    text = response.choices[0].message.content
    assert text.startswith("{")
    if response.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    for extra, pattern in (
        ({"structured_outputs": {"regex": "[0-9]{2}-[a-z]{3}"}}, r"[0-9]{2}-[a-z]{3}"),
        ({"structured_outputs": {"choice": ["left", "right"]}}, r"left|right"),
        ({"guided_regex": "(ab){1,3}c"}, r"(ab){1,3}c"),
        ({"guided_choice": ["up", "down"]}, r"up|down"),
    ):
        completion = client.completions.create(
            model="tiny-llama", prompt="the dog", max_tokens=24, temperature=0, extra_body=extra
        )
        assert re.fullmatch(pattern, completion.choices[0].text), (extra, completion)


def test_guided_json_alias_validates(server):
    completion = server.client().completions.create(
        model="tiny-llama",
        prompt="lily saw",
        max_tokens=96,
        temperature=0,
        extra_body={"guided_json": SCHEMA},
    )
    jsonschema.validate(json.loads(completion.choices[0].text), SCHEMA)


def test_a_constrained_stream_adds_up_to_the_non_streamed_text(server):
    client = server.client()
    kwargs = dict(
        model="tiny-llama",
        prompt="tom and his mom",
        max_tokens=96,
        temperature=0,
        extra_body={"structured_outputs": {"json": SCHEMA}},
    )
    whole = client.completions.create(**kwargs).choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs))
    assert streamed == whole
    jsonschema.validate(json.loads(whole), SCHEMA)


def _json_schema(schema) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"schema": schema}}}


BAD = [
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    (_json_schema("x"), "response_format"),
    (_json_schema({"type": 7}), "response_format"),
    ({"structured_outputs": {"regex": "([a-z"}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": "root ::= nowhere"}}, "structured_outputs"),
    ({"structured_outputs": {"json": "{broken"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"jsn": {}}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a"}, "guided_regex": "b"}, "guided_regex"),
    ({"guided_choice": ["a", 1]}, "guided_choice"),
    ({"guided_json": {"type": "nonsense"}}, "guided_json"),
]  # fmt: skip


@pytest.mark.parametrize("extra, param", BAD)
def test_a_bad_constraint_is_a_400_naming_its_field(server, extra, param):
    body = {"model": "tiny-llama", "prompt": "x", "max_tokens": 4, **extra}
    response = httpx.post(f"{server.api_url}/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert httpx.get(f"{server.base_url}/health").status_code == 200
