"""/v1/completions over real HTTP with the official openai client, checked against
the offline LLM."""

from __future__ import annotations

import json
import math

import httpx2 as httpx
import pytest

from octavo import SamplingParams

PROMPT = "once upon a time there was a little girl"
PROMPTS = ["the cat ran", "she loved to play outside in the park one day", "a big red ball"]


def offline_texts(offline, prompts, **params) -> list[list[str]]:
    outputs = offline.generate(prompts, SamplingParams(**params), use_tqdm=False)
    return [[c.text for c in o.outputs] for o in outputs]


def test_greedy_text_equals_offline(server, offline):
    client = server.client()
    response = client.completions.create(
        model="tiny-llama", prompt=PROMPT, max_tokens=12, temperature=0
    )
    (expected,) = offline_texts(offline, [PROMPT], max_tokens=12, temperature=0)
    assert [c.text for c in response.choices] == expected
    choice = response.choices[0]
    assert choice.index == 0 and choice.finish_reason == "length"
    prompt_ids = offline.get_tokenizer().encode(PROMPT)
    assert response.usage.prompt_tokens == len(prompt_ids)
    assert response.usage.completion_tokens == 12
    assert response.usage.total_tokens == len(prompt_ids) + 12
    assert response.object == "text_completion" and response.model == "tiny-llama"


def test_streamed_text_equals_offline_and_ends_with_usage(server, offline):
    client = server.client()
    stream = client.completions.create(
        model="tiny-llama",
        prompt=PROMPT,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    (expected,) = offline_texts(offline, [PROMPT], max_tokens=12, temperature=0)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected[0]
    assert len([c for c in chunks if c.choices]) > 1, "a stream must arrive in several chunks"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_prompt_forms_text_list_and_token_ids(server, offline):
    client = server.client()
    tokenizer = offline.get_tokenizer()
    expected = offline_texts(offline, PROMPTS, max_tokens=6, temperature=0)
    response = client.completions.create(
        model="tiny-llama", prompt=PROMPTS, max_tokens=6, temperature=0
    )
    assert [c.text for c in sorted(response.choices, key=lambda c: c.index)] == [
        e[0] for e in expected
    ]
    ids = [tokenizer.encode(p) for p in PROMPTS]
    by_ids = client.completions.create(model="tiny-llama", prompt=ids, max_tokens=6, temperature=0)
    assert [c.text for c in sorted(by_ids.choices, key=lambda c: c.index)] == [
        e[0] for e in expected
    ]
    one = client.completions.create(model="tiny-llama", prompt=ids[1], max_tokens=6, temperature=0)
    assert one.choices[0].text == expected[1][0]


def test_n_samples_with_seed_are_reproducible(server, offline):
    client = server.client()
    kwargs = dict(
        model="tiny-llama", prompt=PROMPTS[:2], max_tokens=8, temperature=1.0, n=3, seed=1234
    )
    first = client.completions.create(**kwargs)
    second = client.completions.create(**kwargs)
    assert sorted(c.index for c in first.choices) == list(range(6))
    texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert texts == [c.text for c in sorted(second.choices, key=lambda c: c.index)]
    assert len(set(texts[:3])) > 1, "n samples of one prompt should differ at temperature 1"
    expected = offline_texts(offline, PROMPTS[:2], max_tokens=8, temperature=1.0, n=3, seed=1234)
    assert texts == expected[0] + expected[1]
    assert first.usage.completion_tokens == 6 * 8


def test_stop_string_matches_offline(server, offline):
    client = server.client()
    (full,) = offline_texts(offline, [PROMPT], max_tokens=16, temperature=0)
    stop = full[0][3:5]
    assert stop.strip(), "the greedy output should have a usable stop string"
    (expected,) = offline_texts(offline, [PROMPT], max_tokens=16, temperature=0, stop=[stop])
    for stream in (False, True):
        response = client.completions.create(
            model="tiny-llama",
            prompt=PROMPT,
            max_tokens=16,
            temperature=0,
            stop=[stop],
            stream=stream,
        )
        chunks = list(response) if stream else [response]
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == expected[0] and stop not in text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_logprobs_match_offline(server, offline):
    client = server.client()
    response = client.completions.create(
        model="tiny-llama", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3
    )
    (reference,) = offline.generate(
        [PROMPT], SamplingParams(max_tokens=5, temperature=0, logprobs=3), use_tqdm=False
    )
    logprobs = response.choices[0].logprobs
    expected = reference.outputs[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 5
    for position, token, value, top in zip(
        expected, logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs
    ):
        chosen = next(iter(position.values()))
        assert token == chosen.decoded_token
        assert math.isclose(value, chosen.logprob, rel_tol=1e-5, abs_tol=1e-6)
        assert 1 <= len(top) <= 3 and max(top.values()) == pytest.approx(
            value, abs=1e-6
        )  # greedy: chosen is top-1
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(5)]
    stream = client.completions.create(
        model="tiny-llama", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3, stream=True
    )
    streamed = [
        v
        for c in stream
        for v in (
            c.choices[0].logprobs.token_logprobs if c.choices and c.choices[0].logprobs else []
        )
    ]
    assert streamed == pytest.approx(logprobs.token_logprobs, abs=1e-6)


def test_echo_prepends_the_prompt(server, offline):
    client = server.client()
    (expected,) = offline_texts(offline, [PROMPT], max_tokens=4, temperature=0)
    response = client.completions.create(
        model="tiny-llama", prompt=PROMPT, max_tokens=4, temperature=0, echo=True
    )
    assert response.choices[0].text == PROMPT + expected[0]
    stream = client.completions.create(
        model="tiny-llama", prompt=PROMPT, max_tokens=4, temperature=0, echo=True, stream=True
    )
    assert "".join(c.choices[0].text for c in stream) == PROMPT + expected[0]


def test_extra_body_fields_are_applied(server, offline):
    client = server.client()
    extra = {
        "top_k": 1,
        "min_p": 0.0,
        "ignore_eos": True,
        "cache_salt": "tenant-a",
        "priority": 0,
        "min_tokens": 3,
    }
    response = client.completions.create(
        model="tiny-llama",
        prompt=PROMPT,
        max_tokens=6,
        temperature=1.0,
        extra_body=extra,
        presence_penalty=0.0,
        frequency_penalty=0.0,
        user="someone",
    )
    # top_k=1 makes sampling greedy whatever the temperature.
    (expected,) = offline_texts(offline, [PROMPT], max_tokens=6, temperature=0)
    assert response.choices[0].text == expected[0]


def test_penalties_and_logit_bias_are_applied(server, offline):
    """The sampling adjustments reach the model runner: the server's greedy text equals the offline
    engine's under the same settings, and differs from plain greedy."""
    client = server.client()
    tokenizer = offline.get_tokenizer()
    (plain,) = offline_texts(offline, [PROMPT], max_tokens=16, temperature=0)
    forced = tokenizer.encode(" ball", add_special_tokens=False)[-1]
    cases = [
        ({"frequency_penalty": 2.0, "presence_penalty": 1.0}, {}),
        ({"logit_bias": {str(forced): 100}}, {}),
        ({}, {"repetition_penalty": 3.0}),
    ]
    for fields, extra_body in cases:
        response = client.completions.create(
            model="tiny-llama",
            prompt=PROMPT,
            max_tokens=16,
            temperature=0,
            extra_body=extra_body,
            **fields,
        )
        params = {**fields, **extra_body}
        if "logit_bias" in params:
            params["logit_bias"] = {int(k): v for k, v in params["logit_bias"].items()}
        (expected,) = offline_texts(offline, [PROMPT], max_tokens=16, temperature=0, **params)
        assert response.choices[0].text == expected[0], params
        assert expected[0] != plain[0], f"{params} changed nothing"
    biased = client.completions.create(
        model="tiny-llama",
        prompt=PROMPT,
        max_tokens=4,
        temperature=0,
        logit_bias={str(forced): 100},
    )
    assert tokenizer.encode(biased.choices[0].text, add_special_tokens=False) == [forced] * 4


def test_request_id_is_echoed(server):
    with httpx.Client(base_url=server.base_url) as http:
        body = {"prompt": "the", "max_tokens": 1}
        given = http.post("/v1/completions", json=body, headers={"X-Request-Id": "my-trace-42"})
        fresh = http.post("/v1/completions", json=body)
    assert given.status_code == 200 and given.headers["x-request-id"] == "my-trace-42"
    assert len(fresh.headers["x-request-id"]) >= 16
    assert json.loads(fresh.text)["id"].startswith("cmpl-")
