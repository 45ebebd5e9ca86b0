"""/v1/chat/completions, /tokenize and /detokenize over real HTTP, checked against
the offline LLM."""

from __future__ import annotations

import math

import httpx2 as httpx
import pytest

from octavo import SamplingParams

MESSAGES = [
    {"role": "system", "content": "you tell short stories"},
    {"role": "user", "content": "tell me about a little dog"},
]


def offline_chat(offline, chat_ids, messages, **params):
    (output,) = offline.generate(
        [{"prompt_token_ids": chat_ids(messages)}], SamplingParams(**params), use_tqdm=False
    )
    return output


def test_greedy_reply_equals_offline(server, offline, chat_ids):
    response = server.client().chat.completions.create(
        model="tiny-llama", messages=MESSAGES, max_completion_tokens=10, temperature=0
    )
    expected = offline_chat(offline, chat_ids, MESSAGES, max_tokens=10, temperature=0)
    choice = response.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == expected.outputs[0].text
    assert choice.finish_reason == "length"
    assert (
        response.usage.prompt_tokens == len(chat_ids(MESSAGES))
        and response.usage.completion_tokens == 10
    )
    assert response.object == "chat.completion" and response.id.startswith("chatcmpl-")


def test_stream_role_first_finish_last(server, offline, chat_ids):
    stream = server.client().chat.completions.create(
        model="tiny-llama",
        messages=MESSAGES,
        max_completion_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    expected = offline_chat(offline, chat_ids, MESSAGES, max_tokens=10, temperature=0)
    with_choices = [c for c in chunks if c.choices]
    assert with_choices[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in with_choices[1:])
    assert (
        "".join(c.choices[0].delta.content or "" for c in with_choices) == expected.outputs[0].text
    )
    assert with_choices[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in with_choices[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_n_choices_and_max_tokens_alias(server):
    client = server.client()
    response = client.chat.completions.create(
        model="tiny-llama", messages=MESSAGES, max_tokens=5, temperature=1.0, n=3, seed=7
    )
    assert sorted(c.index for c in response.choices) == [0, 1, 2]
    assert response.usage.completion_tokens == 15
    stream = client.chat.completions.create(
        model="tiny-llama",
        messages=MESSAGES,
        max_tokens=5,
        temperature=1.0,
        n=3,
        seed=7,
        stream=True,
    )
    texts = {i: "" for i in range(3)}
    finishes = {}
    for chunk in stream:
        choice = chunk.choices[0]
        assert choice.index not in finishes, "no chunk of a choice after its finish_reason"
        texts[choice.index] += choice.delta.content or ""
        if choice.finish_reason:
            finishes[choice.index] = choice.finish_reason
    assert finishes == {0: "length", 1: "length", 2: "length"}
    assert [texts[i] for i in range(3)] == [
        c.message.content for c in sorted(response.choices, key=lambda c: c.index)
    ]


def test_logprobs_and_top_logprobs(server, offline, chat_ids):
    response = server.client().chat.completions.create(
        model="tiny-llama",
        messages=MESSAGES,
        max_completion_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    expected = offline_chat(offline, chat_ids, MESSAGES, max_tokens=4, temperature=0, logprobs=2)
    content = response.choices[0].logprobs.content
    assert len(content) == 4
    for entry, position in zip(content, expected.outputs[0].logprobs):
        chosen = next(iter(position.values()))
        assert entry.token == chosen.decoded_token and bytes(entry.bytes) == entry.token.encode()
        assert math.isclose(entry.logprob, chosen.logprob, rel_tol=1e-5, abs_tol=1e-6)
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-6)  # greedy
    plain = server.client().chat.completions.create(
        model="tiny-llama", messages=MESSAGES, max_completion_tokens=2, temperature=0
    )
    assert plain.choices[0].logprobs is None


def test_content_parts_and_developer_role(server):
    parts = [
        {"role": "developer", "content": "be brief"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}],
        },
    ]
    plain = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    client = server.client()
    first = client.chat.completions.create(
        model="tiny-llama", messages=parts, max_completion_tokens=6, temperature=0
    )
    second = client.chat.completions.create(
        model="tiny-llama", messages=plain, max_completion_tokens=6, temperature=0
    )
    assert first.choices[0].message.content == second.choices[0].message.content
    assert first.usage.prompt_tokens == second.usage.prompt_tokens


def test_tokenize_and_detokenize(server, offline, chat_ids):
    tokenizer = offline.get_tokenizer()
    with httpx.Client(base_url=server.base_url) as http:
        text = http.post("/tokenize", json={"prompt": "the little cat"}).json()
        chat = http.post("/tokenize", json={"messages": MESSAGES}).json()
        back = http.post("/detokenize", json={"tokens": text["tokens"]}).json()
    assert text["tokens"] == tokenizer.encode("the little cat") and text["count"] == len(
        text["tokens"]
    )
    assert text["max_model_len"] == 256
    assert chat["tokens"] == chat_ids(MESSAGES)
    assert back["prompt"] == tokenizer.decode(text["tokens"])


def test_models_version_and_health(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] == ["tiny-llama"]
    with httpx.Client(base_url=server.base_url) as http:
        assert http.get("/version").json()["version"]
        assert http.get("/health").status_code == 200
        ready = http.get("/health/ready")
        assert ready.status_code == 200 and ready.json()["status"] == "ready"
        assert http.get("/v1/models/tiny-llama").json()["id"] == "tiny-llama"
