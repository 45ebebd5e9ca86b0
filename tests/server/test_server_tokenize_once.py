"""A prompt is tokenised exactly once on its way from HTTP to the engine (and once offline):
the tokenizer's backend counts every text it encodes while one request runs."""

from __future__ import annotations

import contextlib

import pytest

MESSAGES = [{"role": "user", "content": "tell me about the little cat"}]


class CountingBackend:
    """Wraps a ``tokenizers.Tokenizer``: counts the texts it encodes, delegates the rest."""

    def __init__(self, inner) -> None:
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "num_encoded", 0)

    def encode(self, *args, **kwargs):
        object.__setattr__(self, "num_encoded", self.num_encoded + 1)
        return self._inner.encode(*args, **kwargs)

    def encode_batch(self, inputs, *args, **kwargs):
        object.__setattr__(self, "num_encoded", self.num_encoded + len(inputs))
        return self._inner.encode_batch(inputs, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def __setattr__(self, name, value):
        setattr(self._inner, name, value)


@contextlib.contextmanager
def counting_encodes(tokenizer):
    """Count the texts ``tokenizer`` (a transformers fast tokenizer) encodes in the block."""
    inner = tokenizer._tokenizer
    counter = CountingBackend(inner)
    tokenizer._tokenizer = counter
    try:
        yield counter
    finally:
        tokenizer._tokenizer = inner


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

    with counting_encodes(offline.get_tokenizer()) as counter:
        offline.generate("once upon a time", SamplingParams(max_tokens=2), use_tqdm=False)
        offline.chat(MESSAGES, SamplingParams(max_tokens=2), use_tqdm=False)
    assert counter.num_encoded == 2
