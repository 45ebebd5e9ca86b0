"""InputProcessor: every prompt form to one ProcessedRequest, with each check made here, once."""

from __future__ import annotations

import pytest

from octavo import SamplingParams
from octavo.inputs import (
    InputProcessor,
    PromptError,
    RequestOptions,
    TextPrompt,
    TokensPrompt,
)


class WordTokenizer:
    """One id per word (the word's length), plus BOS 1: enough to see what was encoded."""

    def __init__(self) -> None:
        self.encoded: list[str] = []

    def encode(self, text: str) -> list[int]:
        self.encoded.append(text)
        return [1, *(len(word) for word in text.split())]


@pytest.fixture
def tokenizer() -> WordTokenizer:
    return WordTokenizer()


@pytest.fixture
def inputs(tokenizer) -> InputProcessor:
    return InputProcessor(tokenizer, vocab_size=50, max_model_len=8, eos_token_ids=(2,))


@pytest.mark.parametrize(
    "prompt, token_ids, text",
    [
        ("the cat sat", [1, 3, 3, 3], "the cat sat"),
        (TextPrompt(prompt="a big dog"), [1, 1, 3, 3], "a big dog"),
        ([4, 5, 6], [4, 5, 6], None),
        (TokensPrompt(prompt_token_ids=[7, 8]), [7, 8], None),
        (TokensPrompt(prompt_token_ids=[7, 8], prompt="seven eight"), [7, 8], "seven eight"),
    ],
)
def test_every_prompt_form_becomes_the_same_processed_prompt(inputs, prompt, token_ids, text):
    request = inputs.process("r", prompt, SamplingParams())
    assert request.prompt.token_ids == tuple(token_ids) and request.prompt.text == text


def test_text_is_encoded_once_and_token_ids_never(inputs, tokenizer):
    inputs.process("a", "the cat sat", SamplingParams())
    inputs.process(
        "b", TokensPrompt(prompt_token_ids=[7, 8], prompt="not encoded"), SamplingParams()
    )
    assert tokenizer.encoded == ["the cat sat"]


@pytest.mark.parametrize(
    "prompt, match, code",
    [
        ([], "prompt is empty", None),
        ("", "prompt is empty", None),
        ([1, 50], r"prompt token ids must be in \[0, 50\)", None),
        ([-1, 3], r"prompt token ids must be in \[0, 50\)", None),
        ([1] * 8, "8 tokens.*max_model_len=8", "context_length_exceeded"),
        ({"text": "x"}, "'prompt'.*'prompt_token_ids'", None),
        ([1, True], "a list of token ids", None),
        (3.5, "a list of token ids", None),
    ],
)
def test_bad_prompts_raise_prompt_error_naming_the_prompt(inputs, prompt, match, code):
    with pytest.raises(PromptError, match=match) as caught:
        inputs.process("r", prompt, SamplingParams())
    assert caught.value.code == code and str(caught.value).startswith("prompt")


def test_the_longest_prompt_leaves_one_token_to_generate(inputs):
    assert len(inputs.process("r", [1] * 7, SamplingParams()).prompt.token_ids) == 7


def test_params_are_fitted_to_the_vocabulary(inputs):
    assert inputs.process("r", [1], SamplingParams(top_k=51)).params.top_k == 0
    assert inputs.process("r", [1], SamplingParams(top_k=50)).params.top_k == 50
    with pytest.raises(ValueError, match="^stop_token_ids has token id 50"):
        inputs.process("r", [1], SamplingParams(stop_token_ids=[50]))


def test_options_travel_as_one_record_and_arrival_time_is_set(inputs, monkeypatch):
    import octavo.inputs.processor as processor_module

    monkeypatch.setattr(processor_module.time, "time", lambda: 1234.5)  # a fixed clock
    request = inputs.process("r", [1], SamplingParams(), RequestOptions(priority=3))
    assert request.options.priority == 3 and request.options.cache_salt is None
    assert request.options.arrival_time == 1234.5  # stamped when processed
    given = inputs.process("r", [1], SamplingParams(), RequestOptions(arrival_time=12.5))
    assert given.options.arrival_time == 12.5


def test_a_prompt_dict_may_carry_the_cache_salt(inputs):
    salted = TokensPrompt(prompt_token_ids=[1, 2], cache_salt="tenant-a")
    assert inputs.process("r", salted, SamplingParams()).options.cache_salt == "tenant-a"
    explicit = RequestOptions(cache_salt="tenant-b")
    plain = TokensPrompt(prompt_token_ids=[1, 2])
    assert inputs.process("r", plain, SamplingParams(), explicit).options.cache_salt == "tenant-b"


@pytest.mark.parametrize(
    "options, match",
    [
        (dict(priority=2**63), "^priority must be in"),
        (dict(priority=1.5), "^priority must be an integer"),
        (dict(priority=True), "^priority must be an integer"),
        (dict(cache_salt=""), "^cache_salt must be a non-empty string"),
    ],
)
def test_bad_options_raise_value_error_naming_the_field(options, match):
    with pytest.raises(ValueError, match=match):
        RequestOptions(**options)


def test_text_without_a_tokenizer_is_refused():
    inputs = InputProcessor(None, vocab_size=50, max_model_len=8)
    assert inputs.process("r", [3, 4], SamplingParams()).prompt.token_ids == (3, 4)
    with pytest.raises(PromptError, match="no tokenizer"):
        inputs.process("r", "text", SamplingParams())


def test_the_offline_api_takes_every_prompt_form_alike(tiny_model):
    from engine_helpers import make_llm

    from octavo import TextPrompt as PublicTextPrompt
    from octavo import TokensPrompt as PublicTokensPrompt

    llm = make_llm(tiny_model)
    token_ids = llm.get_tokenizer().encode("the cat sat on the mat")
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    forms = [
        "the cat sat on the mat",
        PublicTextPrompt(prompt="the cat sat on the mat"),
        token_ids,
        PublicTokensPrompt(prompt_token_ids=token_ids),
    ]
    outputs = llm.generate(forms, greedy, use_tqdm=False)
    assert len({tuple(o.outputs[0].token_ids) for o in outputs}) == 1
    assert [o.prompt_token_ids for o in outputs] == [token_ids] * 4
    assert [o.prompt for o in outputs] == ["the cat sat on the mat"] * 2 + [None, None]
    with pytest.raises(ValueError, match="^priority must be in"):
        llm.generate(token_ids, greedy, priority=[2**63], use_tqdm=False)


def test_one_bad_prompt_refuses_the_whole_call_and_queues_nothing(tiny_model):
    from engine_helpers import make_llm

    llm = make_llm(tiny_model)
    greedy = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate([[1, 2, 3], [], [4, 5]], greedy, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    (output,) = llm.generate([[1, 2, 3]], greedy, use_tqdm=False)
    assert output.finished and len(output.outputs[0].token_ids) == 2


def test_numpy_priorities_are_integers():
    numpy = pytest.importorskip("numpy")
    options = RequestOptions(priority=numpy.int64(3))
    assert options.priority == 3 and type(options.priority) is int


def test_a_cache_salt_given_twice_must_agree(inputs):
    salted = TokensPrompt(prompt_token_ids=[1, 2], cache_salt="tenant-a")
    same = RequestOptions(cache_salt="tenant-a")
    assert inputs.process("r", salted, SamplingParams(), same).options.cache_salt == "tenant-a"
    with pytest.raises(ValueError, match="^cache_salt is given twice"):
        inputs.process("r", salted, SamplingParams(), RequestOptions(cache_salt="tenant-b"))


@pytest.mark.parametrize(
    "params, match",
    [
        (SamplingParams(prompt_logprobs=1), "^prompt_logprobs is not supported yet"),
        (SamplingParams(stop=["x"]), "^stop strings need a tokenizer"),
    ],
)
def test_what_the_engine_cannot_do_is_refused(params, match):
    inputs = InputProcessor(None, vocab_size=50, max_model_len=8)
    with pytest.raises(ValueError, match=match):
        inputs.process("r", [1], params)


def test_a_processed_prompt_is_not_checked_again(inputs, tokenizer):
    prompt = inputs.process_prompt("the cat", field="messages")
    request = inputs.process("r", prompt, SamplingParams())
    assert request.prompt is prompt and tokenizer.encoded == ["the cat"]
    with pytest.raises(PromptError, match="^messages is empty"):
        inputs.process_prompt([], field="messages")
