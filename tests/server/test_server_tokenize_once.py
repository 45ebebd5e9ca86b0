"""A prompt is tokenised exactly once on its way from HTTP to the engine (and once offline):
the tokenizer's backends count every text they encode while one request runs."""

from __future__ import annotations

import contextlib

import pytest

MESSAGES = [{"role": "user", "content": "tell me about the little cat"}]


class CountingBackend:
    """Wraps a ``tokenizers.Tokenizer``: counts the texts it encodes into ``counts``, delegates
    the rest."""

    def __init__(self, inner, counts: list[int]) -> None:
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "_counts", counts)

    def encode(self, *args, **kwargs):
        self._counts[0] += 1
        return self._inner.encode(*args, **kwargs)

    def encode_batch(self, inputs, *args, **kwargs):
        self._counts[0] += len(inputs)
        return self._inner.encode_batch(inputs, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def __setattr__(self, name, value):
        setattr(self._inner, name, value)


class Counter:
    def __init__(self) -> None:
        self.counts = [0]

    @property
    def num_encoded(self) -> int:
        return self.counts[0]


@contextlib.contextmanager
def counting_encodes(tokenizer):
    """Count the texts the engine's tokenizer encodes in the block: through its own backend, and
    through its transformers tokenizer's (chat templates render and encode there)."""
    owners = [(tokenizer, "_backend"), (tokenizer.hf, "_tokenizer")]
    counter = Counter()
    inners = [getattr(owner, name) for owner, name in owners]
    for (owner, name), inner in zip(owners, inners):
        setattr(owner, name, CountingBackend(inner, counter.counts))
    try:
        yield counter
    finally:
        for (owner, name), inner in zip(owners, inners):
            setattr(owner, name, inner)


def test_the_counter_sees_a_direct_encode(server):
    # Guards the test itself: a tokenizer path the counter missed would make the others vacuous.
    with counting_encodes(server.engine.tokenizer) as counter:
        server.engine.tokenizer.encode("once upon a time")
        server.engine.tokenizer.apply_chat_template(MESSAGES, tokenize=True)
    assert counter.num_encoded == 2


@pytest.mark.parametrize("stream", [False, True])
def test_a_text_completion_is_tokenized_once(server, stream):
    client = server.client()
    with counting_encodes(server.engine.tokenizer) as counter:
        response = client.completions.create(
            model="tiny-llama", prompt="once upon a time", max_tokens=3, stream=stream
        )
        if stream:
            list(response)
    assert counter.num_encoded == 1


def test_each_prompt_of_a_batch_is_tokenized_once_and_token_ids_never(server):
    client = server.client()
    with counting_encodes(server.engine.tokenizer) as counter:
        client.completions.create(
            model="tiny-llama", prompt=["the cat", "a dog ran"], max_tokens=2, echo=True
        )
        after_texts = counter.num_encoded
        client.completions.create(model="tiny-llama", prompt=[1, 5, 9], max_tokens=2)
    assert after_texts == 2 and counter.num_encoded == 2


def test_a_chat_completion_is_tokenized_once(server):
    client = server.client()
    with counting_encodes(server.engine.tokenizer) as counter:
        client.chat.completions.create(model="tiny-llama", messages=MESSAGES, max_tokens=3)
    assert counter.num_encoded == 1


def test_an_offline_prompt_is_tokenized_once(offline):
    from octavo import SamplingParams

    with counting_encodes(offline.engine.tokenizer) as counter:
        offline.generate("once upon a time", SamplingParams(max_tokens=2), use_tqdm=False)
        offline.chat(MESSAGES, SamplingParams(max_tokens=2), use_tqdm=False)
    assert counter.num_encoded == 2
