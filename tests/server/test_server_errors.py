"""Bad requests get the right status and OpenAI's error body, and never disturb
requests in flight."""

from __future__ import annotations

import json

import httpx2 as httpx
import pytest
from engine_gate import EngineGate  # noqa: E402  (tests/server/engine_gate.py)

from octavo import SamplingParams

CHAT = [{"role": "user", "content": "hi"}]
TOO_LONG = list(range(3, 303))  # 300 tokens; the model's context is 256

# (endpoint, body: dict or raw bytes, status, param, code)
BAD_REQUESTS = [
    ("/v1/completions", b'{"prompt":', 400, None, "invalid_json"),
    ("/v1/completions", b"[1, 2]", 400, None, None),
    ("/v1/completions", {"max_tokens": 4}, 400, "prompt", None),
    ("/v1/completions", {"prompt": 12}, 400, "prompt", None),
    ("/v1/completions", {"prompt": "", "max_tokens": 4}, 400, "prompt", None),
    ("/v1/completions", {"prompt": []}, 400, "prompt", None),
    ("/v1/completions", {"prompt": [99999]}, 400, "prompt", None),
    ("/v1/completions", {"prompt": TOO_LONG}, 400, "prompt", "context_length_exceeded"),
    (
        "/v1/completions",
        {"prompt": "hi", "max_tokens": 300},
        400,
        "max_tokens",
        "context_length_exceeded",
    ),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "5"}, 400, "max_tokens", None),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", None),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n", None),
    ("/v1/completions", {"prompt": "hi", "n": 1000}, 400, "n", None),
    ("/v1/completions", {"prompt": "hi", "n": 2.5}, 400, "n", None),
    ("/v1/completions", {"prompt": "hi", "logprobs": 50}, 400, "logprobs", None),
    ("/v1/completions", {"prompt": "hi", "logprobs": -1}, 400, "logprobs", None),
    ("/v1/completions", {"prompt": "hi", "echo": True, "logprobs": 1}, 400, "logprobs", None),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature", None),
    ("/v1/completions", {"prompt": "hi", "temperature": True}, 400, "temperature", None),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p", None),
    ("/v1/completions", {"prompt": "hi", "top_k": -5}, 400, "top_k", None),
    ("/v1/completions", {"prompt": "hi", "stop": 5}, 400, "stop", None),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"x": 1}}, 400, "logit_bias", None),
    ("/v1/completions", {"prompt": "hi", "seed": "abc"}, 400, "seed", None),
    ("/v1/completions", {"prompt": "hi", "seed": 2**64}, 400, "seed", None),
    ("/v1/completions", {"prompt": "hi", "top_k": 2**31}, 400, "top_k", None),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [600]}, 400, "stop_token_ids", None),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"600": 1}}, 400, "logit_bias", None),
    # every token banned until min_tokens: nothing could be sampled (it failed inside the step)
    (
        "/v1/completions",
        {"prompt": "hi", "min_tokens": 2, "stop_token_ids": list(range(512))},
        400,
        "stop_token_ids",
        None,
    ),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, 400, "stream", None),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model", "model_not_found"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", None),
    ("/v1/chat/completions", {"max_tokens": 3}, 400, "messages", None),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "robot", "content": "hi"}]},
        400,
        "messages",
        None,
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        "messages",
        None,
    ),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, 400, "top_logprobs", None),
    (
        "/v1/chat/completions",
        {"messages": CHAT, "logprobs": True, "top_logprobs": 30},
        400,
        "top_logprobs",
        None,
    ),
    (
        "/v1/chat/completions",
        {"messages": CHAT, "max_completion_tokens": 1000},
        400,
        "max_completion_tokens",
        "context_length_exceeded",
    ),
    ("/v1/chat/completions", {"messages": CHAT, "model": "nope"}, 404, "model", "model_not_found"),
    (
        "/v1/chat/completions",
        {"messages": CHAT, "tools": [{"type": "function"}]},
        400,
        "tools",
        None,
    ),
    ("/tokenize", {}, 400, "prompt", None),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens", None),
    ("/v1/no-such-route", {}, 404, None, None),
]


def post(http: httpx.Client, endpoint: str, body) -> httpx.Response:
    if isinstance(body, bytes):
        return http.post(endpoint, content=body, headers={"content-type": "application/json"})
    return http.post(endpoint, json=body)


def assert_error(response: httpx.Response, status: int, param, code) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    assert error["param"] == param, error
    assert error["code"] == code, error


@pytest.mark.parametrize(
    "endpoint, body, status, param, code", BAD_REQUESTS, ids=range(len(BAD_REQUESTS))
)
def test_bad_request_gets_openai_error(server, endpoint, body, status, param, code):
    with httpx.Client(base_url=server.base_url) as http:
        assert_error(post(http, endpoint, body), status, param, code)


def test_openai_client_raises_typed_errors(server):
    import openai

    client = server.client()
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="tiny-llama", prompt="hi", n=0)
    assert bad.value.body["param"] == "n"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="unknown", messages=CHAT)


def test_bad_requests_do_not_disturb_a_stream_in_flight(server, offline):
    prompt = "once upon a time"
    body = {
        "prompt": prompt,
        "max_tokens": 200,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    (expected,) = offline.generate(
        [prompt], SamplingParams(max_tokens=200, temperature=0, ignore_eos=True), use_tqdm=False
    )
    text, finish = "", None
    with (
        httpx.Client(base_url=server.base_url, timeout=60) as http,
        http.stream("POST", "/v1/completions", json=body) as stream,
    ):
        lines = stream.iter_lines()
        # The engine is held in the stream's 2nd step while the bad requests are answered, so the
        # stream is in flight for every one of them however fast the machine is.
        with EngineGate(server.engine, passes=1) as gate:
            first = next(line for line in lines if line)
            text += json.loads(first.removeprefix("data: "))["choices"][0]["text"]
            gate.wait_held()
            with httpx.Client(base_url=server.base_url, timeout=30) as other:
                for endpoint, bad, status, param, code in BAD_REQUESTS:
                    assert_error(post(other, endpoint, bad), status, param, code)
                    assert server.engine.has_unfinished_requests(), "the stream is in flight"
        for line in lines:
            if not line or line == "data: [DONE]":
                continue
            choice = json.loads(line.removeprefix("data: "))["choices"][0]
            text += choice["text"]
            finish = choice["finish_reason"] or finish
    assert text == expected.outputs[0].text and finish == "length"
    server.wait_idle()
    good = server.client().completions.create(
        model="tiny-llama", prompt=prompt, max_tokens=5, temperature=0
    )
    assert good.choices[0].text == expected.outputs[0].text[: len(good.choices[0].text)]
