"""Incremental detokenisation: whole characters only, same text as a one-shot decode,
O(1) per token."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from octavo.outputs.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer, TokenizerAdapter
from octavo.testing.tokenizers import byte_level_bpe

TEXTS = [
    "Hello world! The quick brown fox.",
    "日本語 😀 café naïve",
    "😀😀 mixed 日本 and English, then 語.",
    "e\u0301 combining accent and 👩\u200d👩\u200d👧 a joined emoji family",
]


@pytest.fixture(scope="module")
def bpe():
    return byte_level_bpe()


class DecodeOnly:
    """A tokenizer offering only ``decode`` (no tokenizers backend), recording each
    call's length."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self.decoded_lengths: list[int] = []

    def decode(self, ids, skip_special_tokens=False):
        self.decoded_lengths.append(len(ids))
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def stream(tokenizer, ids, prompt_ids=(), skip_special_tokens=True) -> list[str]:
    """Every delta, the flushed remainder last."""
    detok = IncrementalDetokenizer(
        TokenizerAdapter(tokenizer), list(prompt_ids), skip_special_tokens
    )
    deltas = [detok.step(token_id) for token_id in ids]
    return deltas + [detok.flush()]


def test_fixture_splits_multibyte_characters_across_tokens(bpe):
    # Without this the tests below would not exercise held-back characters.
    ids = bpe.encode("日本語 😀").ids
    assert len(ids) > len("日本語 😀")
    assert all(bpe.decode([token_id]) == REPLACEMENT_CHAR for token_id in bpe.encode("😀").ids)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("backend", ["decode_stream", "prefix_offset"])
def test_deltas_are_whole_characters_and_join_to_decode(bpe, text, backend):
    tokenizer = bpe if backend == "decode_stream" else DecodeOnly(bpe)
    ids = bpe.encode(text).ids
    deltas = stream(tokenizer, ids)
    assert all(REPLACEMENT_CHAR not in delta for delta in deltas)
    assert "".join(deltas) == bpe.decode(ids) == text
    assert deltas[-1] == ""  # nothing was left to flush in well-formed text


def test_a_character_appears_with_the_token_that_completes_it(bpe):
    ids = bpe.encode("😀").ids
    deltas = stream(bpe, ids)[:-1]
    assert deltas == [""] * (len(ids) - 1) + ["😀"]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_special_tokens_follow_skip_special_tokens(bpe, skip_special_tokens):
    # bos, a character split by an eos token in its middle, then text.
    emoji = bpe.encode("😀").ids
    ids = [1] + bpe.encode("Hi ").ids + emoji[:2] + [2] + emoji[2:] + bpe.encode(" there").ids
    joined = "".join(stream(bpe, ids, skip_special_tokens=skip_special_tokens))
    assert joined == bpe.decode(ids, skip_special_tokens=skip_special_tokens)
    assert ("<s>" in joined) is (not skip_special_tokens)
    if skip_special_tokens:
        assert joined == "Hi 😀 there"


def test_incomplete_character_at_the_end_is_flushed_as_decode_renders_it(bpe):
    ids = bpe.encode("ok 😀").ids[:-1]  # the emoji's last byte never comes
    deltas = stream(bpe, ids)
    assert REPLACEMENT_CHAR not in "".join(deltas[:-1])
    assert deltas[-1] == REPLACEMENT_CHAR
    assert "".join(deltas) == bpe.decode(ids)


def test_invalid_bytes_mid_output_match_decode(bpe):
    emoji = bpe.encode("😀").ids
    ids = bpe.encode("a").ids + emoji[:2] + bpe.encode("b日").ids + emoji[3:] + bpe.encode("c").ids
    assert "".join(stream(bpe, ids)) == bpe.decode(ids)


@settings(max_examples=150, deadline=None)
@given(data=st.data(), skip_special_tokens=st.booleans())
def test_any_token_sequence_joins_to_decode(bpe, data, skip_special_tokens):
    # Random ids include lone bytes, invalid UTF-8 and special tokens anywhere.
    vocab = st.integers(0, bpe.get_vocab_size() - 1)
    ids = data.draw(st.lists(vocab, max_size=40), label="ids")
    prompt = data.draw(st.lists(vocab, max_size=8), label="prompt")
    joined = "".join(stream(bpe, ids, prompt, skip_special_tokens))
    prompt_text = bpe.decode(prompt, skip_special_tokens=skip_special_tokens)
    if prompt_text.endswith(REPLACEMENT_CHAR):
        # A prompt ending mid-character is not used as context: the output decodes on its own.
        assert joined == bpe.decode(ids, skip_special_tokens=skip_special_tokens)
    else:
        assert prompt_text + joined == bpe.decode(
            prompt + ids, skip_special_tokens=skip_special_tokens
        )


def test_prefix_offset_decodes_a_bounded_window_per_token(bpe):
    # O(1) per token: each decode call sees only the last chunk and the pending tokens.
    tokenizer = DecodeOnly(bpe)
    ids = bpe.encode(" ".join(TEXTS) * 20).ids
    assert len(ids) > 1000
    assert "".join(stream(tokenizer, ids)) == bpe.decode(ids)
    assert max(tokenizer.decoded_lengths) <= 8
    assert len(tokenizer.decoded_lengths) <= 2 * len(ids) + 2


def test_library_stream_state_stays_bounded(bpe):
    detok = IncrementalDetokenizer(TokenizerAdapter(bpe), [], True)
    for token_id in bpe.encode(" ".join(TEXTS) * 20).ids:
        detok.step(token_id)
        assert len(detok._context_ids) + len(detok._pending_ids) <= 8


def test_transformers_fast_tokenizer_uses_the_library_stream(bpe):
    transformers = pytest.importorskip("transformers")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe)
    adapter = TokenizerAdapter(fast)
    assert adapter.backend is not None
    assert adapter.special_ids == {0, 1, 2}
    ids = bpe.encode(TEXTS[2]).ids
    assert "".join(stream(fast, ids)) == TEXTS[2]


@pytest.fixture(scope="module")
def stories_tokenizer(stories260k_path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(stories260k_path)


@pytest.mark.shared
def test_stories260k_streams_with_the_prompt_as_context(stories_tokenizer):
    tokenizer = stories_tokenizer
    prompt = tokenizer.encode("Once upon a time")
    output = tokenizer.encode(" there was 日本 😀 girl.", add_special_tokens=False) + [
        tokenizer.eos_token_id
    ]
    deltas = stream(tokenizer, output, prompt)
    assert all(REPLACEMENT_CHAR not in delta for delta in deltas)
    prompt_text = tokenizer.decode(prompt, skip_special_tokens=True)
    full = tokenizer.decode(prompt + output, skip_special_tokens=True)
    # SentencePiece drops the first word's leading space when decoding the output alone; with
    # the prompt as context the space is kept, so prompt text + output text reads right.
    assert prompt_text + "".join(deltas) == full
    assert "".join(deltas) == " there was 日本 😀 girl."
    assert tokenizer.decode(output, skip_special_tokens=True) == "there was 日本 😀 girl."


@pytest.mark.shared
def test_stories260k_without_prompt_joins_to_decode(stories_tokenizer):
    tokenizer = stories_tokenizer
    output = tokenizer.encode("Lily saw 日本 😀 and a cat.")  # starts with bos
    for skip in (True, False):
        assert "".join(stream(tokenizer, output, (), skip)) == tokenizer.decode(
            output, skip_special_tokens=skip
        )
