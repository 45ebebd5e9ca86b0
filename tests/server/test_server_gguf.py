"""``octavo serve FILE.gguf`` over real HTTP: the tokenizer and chat template come from the
file's metadata, and a float32 GGUF of the server's tiny model answers as the folder does."""

from __future__ import annotations

import pytest

pytest.importorskip("gguf")

from octavo.testing.tiny_gguf import write_gguf  # noqa: E402

MESSAGES = [{"role": "user", "content": "tell me about a little dog"}]


@pytest.fixture(scope="module")
def gguf_server(server_model, module_server_factory, tmp_path_factory):
    path = write_gguf(server_model, tmp_path_factory.mktemp("gguf") / "tiny.gguf", "F32")
    return module_server_factory(path)


def test_chat_over_a_gguf_file_answers_as_its_folder(gguf_server, server):
    replies = []
    for running in (gguf_server, server):
        response = running.client().chat.completions.create(
            model="tiny-llama", messages=MESSAGES, max_completion_tokens=12, temperature=0
        )
        replies.append((response.choices[0].message.content, response.usage.prompt_tokens))
    assert replies[0] == replies[1]
    assert replies[0][1] > 8  # the file's chat template wrapped the message


def test_completion_over_a_gguf_file_streams(gguf_server):
    stream = gguf_server.client().completions.create(
        model="tiny-llama", prompt="once upon a time", max_tokens=8, temperature=0, stream=True
    )
    text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    assert text
