"""Tool calling over HTTP with the official client, on the bundled demo model (never trained to
call tools: only the constraint makes its calls well formed): every tool_choice, streamed calls
equal to non-streamed ones, multi-turn conversations with calls and results, and a table of bad
tool requests answered 400 with the server healthy."""

from __future__ import annotations

import json
from pathlib import Path

import httpx2 as httpx
import jsonschema
import pytest

import octavo
from octavo.entrypoints.openai.serving_common import ServerConfig

DEMO_MODEL = Path(octavo.__file__).resolve().parent / "data" / "demo-model"
MODEL = "demo"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 16},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
}
ADD = {
    "type": "object",
    "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
    "required": ["a", "b"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": ADD}},
]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
CHOICES = ["required", {"type": "function", "function": {"name": "add"}}, "auto"]


def tool_server_config() -> ServerConfig:
    return ServerConfig(
        served_model_name=MODEL,
        log_requests=False,
        tool_call_parser="hermes",
        enable_auto_tool_choice=True,
    )


@pytest.fixture(scope="module")
def tool_server(module_server_factory):
    if not (DEMO_MODEL / "config.json").is_file():
        pytest.skip("the bundled demo model is not present")
    return module_server_factory(DEMO_MODEL, tool_server_config(), kv_cache_memory="64MiB")


@pytest.fixture(scope="module")
def opening(tool_server) -> dict:
    """A request under which the demo model opens a call in some of 16 choices (about one in
    five): one tool, and a logit bias towards the tokens of ``<tool_call>`` (it never writes one
    unaided)."""
    tokenizer = tool_server.engine.tokenizer
    ids = tokenizer.encode("<tool_call>", add_special_tokens=False)
    return dict(
        messages=[{"role": "user", "content": "add 5 and 6"}],
        tools=TOOLS[1:],
        logit_bias={str(token_id): 4.0 for token_id in ids},
        n=16,
        temperature=0.8,
        seed=0,
        parallel_tool_calls=False,
    )


def _create(server, stream: bool = False, **kwargs):
    kwargs = {
        "model": MODEL,
        "messages": MESSAGES,
        "tools": TOOLS,
        "temperature": 0,
        "max_completion_tokens": 160,
        **kwargs,
    }
    return server.client().chat.completions.create(stream=stream, **kwargs)


def _calls(message) -> list[tuple[str, str]]:
    return [(call.function.name, call.function.arguments) for call in message.tool_calls or ()]


def _assert_valid(calls: list[tuple[str, str]], names=tuple(SCHEMAS)) -> None:
    for name, arguments in calls:
        assert name in names
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def _streamed(server, **kwargs) -> list[tuple[str, list[tuple[str, str]], str]]:
    """Per choice, ``(content, calls, finish_reason)`` of a stream, from its deltas alone."""
    n = kwargs.get("n", 1)
    content, calls, finish = [""] * n, [{} for _ in range(n)], [None] * n
    ids = set()
    for chunk in _create(server, stream=True, **kwargs):
        (choice,) = chunk.choices
        i = choice.index
        content[i] += choice.delta.content or ""
        for delta in choice.delta.tool_calls or ():
            entry = calls[i].setdefault(delta.index, ["", ""])
            if delta.id is not None:
                assert entry == ["", ""], "a call's id and name come first, once"
                assert delta.id not in ids
                ids.add(delta.id)
                entry[0] = delta.function.name
            entry[1] += delta.function.arguments or ""
        finish[i] = choice.finish_reason or finish[i]
    results = []
    for i in range(n):
        assert sorted(calls[i]) == list(range(len(calls[i])))
        results.append((content[i], [tuple(calls[i][k]) for k in sorted(calls[i])], finish[i]))
    return results


@pytest.mark.parametrize("temperature, seed", [(0, None), (1.0, 1), (1.0, 2)])
def test_required_returns_one_valid_call_without_parallel_calls(tool_server, temperature, seed):
    response = _create(
        tool_server,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=temperature,
        seed=seed,
    )
    (choice,) = response.choices
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    _assert_valid(_calls(choice.message))
    assert choice.message.content is None
    assert choice.finish_reason == "tool_calls"


def test_required_with_parallel_calls_returns_valid_calls_until_the_length_limit(tool_server):
    """The demo model given room for more calls keeps making them: every call it finished is
    valid, and only the last, cut by max_tokens, may be unfinished."""
    (choice,) = _create(tool_server, tool_choice="required", max_completion_tokens=100).choices
    calls = _calls(choice.message)
    assert len(calls) >= 2
    finished = calls if choice.finish_reason == "tool_calls" else calls[:-1]
    assert choice.finish_reason in ("tool_calls", "length")
    _assert_valid(finished)


@pytest.mark.parametrize("temperature, seed", [(0, None), (1.0, 3)])
def test_a_named_tool_is_the_one_call(tool_server, temperature, seed):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    response = _create(tool_server, tool_choice=choice, temperature=temperature, seed=seed)
    (result,) = response.choices
    calls = _calls(result.message)
    assert [name for name, _ in calls] == ["get_weather"]
    _assert_valid(calls)
    assert result.finish_reason == "tool_calls"


def test_none_never_returns_a_call_even_when_the_text_is_one(tool_server):
    """With tool_choice none the output is content, unparsed, though it spells a call."""
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    regex = call.replace("{", "\\{").replace("}", "\\}")
    response = _create(
        tool_server, tool_choice="none", extra_body={"structured_outputs": {"regex": regex}}
    )
    (choice,) = response.choices
    assert choice.message.content == call
    assert not choice.message.tool_calls
    assert choice.finish_reason == "stop"


def test_auto_returns_text_when_the_model_opens_no_call(tool_server):
    (choice,) = _create(tool_server, tool_choice="auto", max_completion_tokens=48).choices
    assert choice.message.content and not choice.message.tool_calls
    assert choice.finish_reason == "length"


def test_auto_returns_text_or_text_then_a_valid_call(tool_server, opening):
    """Where the model opens a call, the constraint makes it well formed."""
    response = _create(tool_server, tool_choice="auto", **opening)
    num_calling = 0
    for choice in response.choices:
        calls = _calls(choice.message)
        if not calls:
            assert choice.message.content and choice.finish_reason == "length"
            continue
        num_calling += 1
        assert len(calls) == 1
        _assert_valid(calls)
        assert choice.finish_reason == "tool_calls"
        assert "<tool_call>" not in (choice.message.content or "")
    assert 0 < num_calling < len(response.choices)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(tool_choice="required"),
        dict(tool_choice="required", parallel_tool_calls=False, n=4, temperature=1.0, seed=7),
        dict(tool_choice={"type": "function", "function": {"name": "add"}}),
        dict(tool_choice="auto", opening=True),
        dict(tool_choice="auto", opening=True, parallel_tool_calls=True),
        dict(tool_choice="none", opening=True),
    ],
)
def test_a_stream_adds_up_to_the_non_streamed_message(tool_server, opening, kwargs):
    kwargs = dict(kwargs)
    if kwargs.pop("opening", False):
        kwargs = {**opening, **kwargs}
    response = _create(tool_server, **kwargs)
    streamed = _streamed(tool_server, **kwargs)
    for choice, (content, calls, finish) in zip(response.choices, streamed):
        assert calls == _calls(choice.message)
        assert (content or None) == (choice.message.content or None)
        assert finish == choice.finish_reason
    if kwargs["tool_choice"] != "none":
        assert any(calls for _, calls, _ in streamed)


def test_a_conversation_with_calls_and_their_results(tool_server):
    messages = [
        {"role": "user", "content": "add 5 and 6"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "add", "arguments": '{"a": 5, "b": 6}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "11"},
        {"role": "assistant", "content": "5 + 6 = 11"},
        {"role": "user", "content": "and 7 and 8?"},
    ]
    kwargs = dict(tools=TOOLS[1:], tool_choice="required", parallel_tool_calls=False)
    response = _create(tool_server, messages=messages, **kwargs)
    _assert_valid(_calls(response.choices[0].message))
    assert response.choices[0].finish_reason == "tool_calls"
    # the prompt holds the earlier turns as the template writes them
    rendered = tool_server.engine.tokenizer.apply_chat_template(
        [
            *messages[:1],
            {
                **messages[1],
                "tool_calls": [{"function": {"name": "add", "arguments": {"a": 5, "b": 6}}}],
            },
            *messages[2:],
        ],
        tools=TOOLS[1:],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 5, "b": 6}}\n</tool_call>' in rendered
    assert "<tool_response>\n11\n</tool_response>" in rendered
    assert response.usage.prompt_tokens == len(
        tool_server.engine.tokenizer.encode(rendered, add_special_tokens=False)
    )


def _post(server, body: dict) -> httpx.Response:
    return httpx.post(f"{server.api_url}/chat/completions", json=body, timeout=60)


def _tool(name="f", parameters=None, **function) -> dict:
    return {
        "type": "function",
        "function": {"name": name, "parameters": parameters or {"type": "object"}, **function},
    }


BAD_TOOL_REQUESTS = [
    ({"tools": {"type": "function"}}, "tools"),  # not a list
    ({"tools": []}, "tools"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools"),
    ({"tools": [{"type": "function"}]}, "tools"),  # no function
    ({"tools": [{"type": "function", "function": {"description": "x"}}]}, "tools"),  # no name
    ({"tools": [_tool(name="has space")]}, "tools"),
    ({"tools": [_tool(name="x" * 65)]}, "tools"),
    ({"tools": [_tool(parameters="object")]}, "tools"),
    ({"tools": [_tool(), _tool()]}, "tools"),  # the same name twice
    (
        {
            "tools": [
                _tool(parameters={"type": "object", "properties": {"a": {"$ref": "#/nope"}}})
            ],
            "tool_choice": "required",
        },
        "tools",
    ),  # a schema xgrammar cannot compile
    (
        {"tools": [_tool()], "tool_choice": {"type": "function", "function": {"name": "g"}}},
        "tool_choice",
    ),  # a named tool not in tools
    ({"tools": [_tool()], "tool_choice": "always"}, "tool_choice"),
    ({"tools": [_tool()], "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),  # no tools to choose from
    (
        {"tools": [_tool()], "tool_choice": "required", "response_format": {"type": "json_object"}},
        "response_format",
    ),
    (
        {"tools": [_tool()], "tool_choice": "required", "parallel_tool_calls": "yes"},
        "parallel_tool_calls",
    ),
    (
        {
            "messages": [
                *MESSAGES,
                {
                    "role": "assistant",
                    "tool_calls": [
                        {
                            "id": "c",
                            "type": "function",
                            "function": {"name": "f", "arguments": "{oops"},
                        }
                    ],
                },
            ]
        },
        "messages",
    ),  # a call's arguments that are not JSON
    ({"messages": [*MESSAGES, {"role": "tool", "content": "21"}]}, "messages"),  # no call id
]


@pytest.mark.parametrize("body, param", BAD_TOOL_REQUESTS)
def test_bad_tool_requests_are_400s_naming_the_field(tool_server, body, param):
    response = _post(tool_server, {"model": MODEL, "messages": MESSAGES, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error"
    # the server stays healthy: a tool request right after is answered
    ok = _create(tool_server, tool_choice="required", parallel_tool_calls=False)
    assert ok.choices[0].message.tool_calls


def test_auto_needs_the_flag_and_calls_need_a_parser(server_factory):
    """As vLLM: without --enable-auto-tool-choice, tool_choice auto (the default with tools) is
    a 400 saying so; without --tool-call-parser, so is any tool choice but none."""
    for config, choice, flag in (
        (
            ServerConfig(served_model_name="tiny-llama", tool_call_parser="hermes"),
            None,
            "--enable-auto-tool-choice",
        ),
        (ServerConfig(served_model_name="tiny-llama"), "required", "--tool-call-parser"),
    ):
        server = server_factory(config)
        body = {"messages": MESSAGES, "tools": [_tool()], "max_tokens": 4}
        if choice is not None:
            body["tool_choice"] = choice
        response = _post(server, body)
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["param"] == "tool_choice" and flag in error["message"]
        body["tool_choice"] = "none"
        assert _post(server, body).status_code == 200


def test_serve_refuses_an_unknown_parser_and_auto_tool_choice_without_one(server_model, capsys):
    from octavo.cli import main

    small = ["--kv-cache-memory", "8MiB"]
    assert main(["serve", str(server_model), *small, "--tool-call-parser", "nope"]) == 2
    assert "--tool-call-parser 'nope' is not installed; use one of: hermes" in (
        capsys.readouterr().err
    )
    assert main(["serve", str(server_model), *small, "--enable-auto-tool-choice"]) == 2
    assert "--enable-auto-tool-choice needs --tool-call-parser" in capsys.readouterr().err


def test_speculation_gives_the_same_calls_in_multi_token_deltas(tool_server, module_server_factory):
    """With n-gram drafts (the call's opening is in the prompt, so they are accepted) a delta
    carries several tokens: the stream still adds up to the same calls as without speculation."""
    spec = module_server_factory(
        DEMO_MODEL,
        tool_server_config(),
        kv_cache_memory="64MiB",
        speculative_config={"method": "ngram", "num_speculative_tokens": 4, "adaptive": False},
    )
    kwargs = dict(tool_choice="required", parallel_tool_calls=False)
    (expected,) = _create(tool_server, **kwargs).choices
    (speculated,) = _create(spec, **kwargs).choices
    assert _calls(speculated.message) == _calls(expected.message)
    num_deltas, usage = 0, None
    for chunk in _create(spec, stream=True, stream_options={"include_usage": True}, **kwargs):
        usage = chunk.usage or usage
        num_deltas += bool(chunk.choices and chunk.choices[0].delta.tool_calls)
    assert num_deltas < usage.completion_tokens  # some deltas held several tokens
    ((_, calls, finish),) = _streamed(spec, **kwargs)
    assert calls == _calls(expected.message) and finish == "tool_calls"


def test_tokenize_renders_the_tools_as_the_chat_endpoint_does(tool_server):
    body = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS}
    counted = httpx.post(f"{tool_server.base_url}/tokenize", json=body, timeout=30).json()
    plain = httpx.post(
        f"{tool_server.base_url}/tokenize", json={**body, "tools": None}, timeout=30
    ).json()
    response = _create(tool_server, tool_choice="none", max_completion_tokens=1)
    assert counted["count"] == response.usage.prompt_tokens > plain["count"]
    bad = httpx.post(
        f"{tool_server.base_url}/tokenize", json={**body, "tools": [{"type": "x"}]}, timeout=30
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tools"
