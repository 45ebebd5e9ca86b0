"""Penalties, logit bias and min_tokens change the sampled tokens as vLLM's do."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import generate_ids, make_llm, shared_prefix_prompts

from octavo import SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model):
    return make_llm(tiny_model)


@torch.no_grad()
def test_repetition_penalty_matches_transformers(tiny_model, llm):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32).eval()
    for prompt in shared_prefix_prompts(3, seed=13):
        expected = hf.generate(
            torch.tensor([prompt]),
            do_sample=False,
            max_new_tokens=16,
            repetition_penalty=1.5,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
        params = SamplingParams(
            temperature=0.0, max_tokens=16, repetition_penalty=1.5, ignore_eos=True
        )
        assert generate_ids(llm, [prompt], params)[0] == expected


def test_presence_and_frequency_penalties_discourage_repeats(llm):
    prompt = shared_prefix_prompts(1, seed=1)[0]
    plain = generate_ids(
        llm, [prompt], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    )[0]
    assert len(set(plain)) < len(plain)  # the tiny model repeats itself without a penalty
    for field in ("presence_penalty", "frequency_penalty"):
        penalised = generate_ids(
            llm,
            [prompt],
            SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, **{field: 2.0}),
        )[0]
        assert len(set(penalised)) > len(set(plain))


def test_logit_bias_and_min_tokens(llm):
    prompt = shared_prefix_prompts(1, seed=6)[0]
    biased = generate_ids(
        llm,
        [prompt],
        SamplingParams(temperature=0.0, max_tokens=5, logit_bias={7: 100.0}, ignore_eos=True),
    )[0]
    assert biased == [7] * 5
    # EOS (2) is forced by the bias, but not before min_tokens tokens; it ends the output.
    forced = SamplingParams(temperature=0.0, max_tokens=20, logit_bias={2: 100.0}, min_tokens=4)
    tokens = generate_ids(llm, [prompt], forced)[0]
    assert len(tokens) == 5 and tokens[-1] == 2 and 2 not in tokens[:4]


def test_out_of_vocabulary_logit_bias_is_a_value_error(llm):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[1, 2, 3]], SamplingParams(logit_bias={9999: 1.0}), use_tqdm=False)
