"""SamplingParams: vLLM's defaults and normalisations, and errors that name the field and range."""

from __future__ import annotations

import dataclasses
import re

import pytest

from octavo.sampling_params import MAX_LOGPROBS, MAX_N, RequestOutputKind, SamplingParams


def test_defaults_match_vllm():
    params = SamplingParams()
    assert (params.n, params.temperature, params.top_p, params.top_k, params.min_p) == (
        1,
        1.0,
        1.0,
        0,
        0.0,
    )
    assert (params.max_tokens, params.min_tokens, params.stop, params.stop_token_ids) == (
        16,
        0,
        None,
        (),
    )
    assert (
        params.skip_special_tokens
        and not params.ignore_eos
        and not params.include_stop_str_in_output
    )
    assert params.output_kind == RequestOutputKind.CUMULATIVE
    assert not params.greedy and SamplingParams(temperature=0).greedy


def test_inputs_are_normalised_to_immutable_forms():
    params = SamplingParams(
        stop="###", stop_token_ids=[5, 6], top_k=-1, logit_bias={"7": 2, 8: -1.5}
    )
    assert params.stop == ("###",)
    assert params.stop_token_ids == (5, 6)
    assert params.top_k == 0
    assert params.logit_bias == {7: 2.0, 8: -1.5}
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.temperature = 0.5


def test_boundary_values_are_accepted():
    SamplingParams(
        n=MAX_N, temperature=0, top_p=1, top_k=1, min_p=1, presence_penalty=-2, frequency_penalty=2
    )
    SamplingParams(
        repetition_penalty=0.01,
        max_tokens=1,
        min_tokens=1,
        logprobs=0,
        prompt_logprobs=MAX_LOGPROBS,
    )
    SamplingParams(max_tokens=None, min_tokens=1000, seed=0, logit_bias={0: -100, 1: 100})
    SamplingParams(seed=-(2**63), top_k=2**31 - 1, repetition_penalty=100, temperature=3.4e38)
    SamplingParams(seed=2**64 - 1)  # every seed torch.Generator.manual_seed takes


def test_tiny_temperatures_are_raised_to_one_hundredth_as_in_vllm():
    # 1e-45 is 0 in float32: dividing logits by it gave NaN inside the shared step.
    assert SamplingParams(temperature=1e-45).temperature == 0.01
    assert SamplingParams(temperature=0.5).temperature == 0.5


# (kwargs, field named first in the message, the allowed range the message must state)
INVALID = [
    (dict(n=0), "n", f"[1, {MAX_N}]"),
    (dict(n=MAX_N + 1), "n", f"[1, {MAX_N}]"),
    (dict(n=2.0), "n", f"[1, {MAX_N}]"),
    (dict(n=True), "n", f"[1, {MAX_N}]"),
    (dict(temperature=-0.1), "temperature", "[0, 3.4e+38]"),
    (dict(temperature=float("nan")), "temperature", "[0, 3.4e+38]"),
    (dict(temperature="hot"), "temperature", "[0, 3.4e+38]"),
    (dict(temperature=1e39), "temperature", "[0, 3.4e+38]"),
    (dict(top_p=0), "top_p", "(0, 1]"),
    (dict(top_p=1.01), "top_p", "(0, 1]"),
    (dict(top_k=-2), "top_k", "[1, 2147483647], or 0 or -1"),
    (dict(top_k=1.5), "top_k", "[1, 2147483647], or 0 or -1"),
    (dict(top_k=2**31), "top_k", "[1, 2147483647], or 0 or -1"),
    (dict(min_p=-0.01), "min_p", "[0, 1]"),
    (dict(min_p=1.5), "min_p", "[0, 1]"),
    (dict(presence_penalty=2.5), "presence_penalty", "[-2, 2]"),
    (dict(frequency_penalty=-2.5), "frequency_penalty", "[-2, 2]"),
    (dict(repetition_penalty=0), "repetition_penalty", "[0.01, 100]"),
    (dict(repetition_penalty=1e-300), "repetition_penalty", "[0.01, 100]"),
    (dict(repetition_penalty=1e3), "repetition_penalty", "[0.01, 100]"),
    (dict(seed=1.5), "seed", "integer"),
    (dict(seed=2**64), "seed", f"[{-(2**63)}, {2**64 - 1}]"),
    (dict(seed=-(2**63) - 1), "seed", f"[{-(2**63)}, {2**64 - 1}]"),
    (dict(max_tokens=0), "max_tokens", ">= 1"),
    (dict(max_tokens=3.0), "max_tokens", ">= 1"),
    (dict(min_tokens=-1), "min_tokens", ">= 0"),
    (dict(max_tokens=4, min_tokens=5), "min_tokens", "[0, max_tokens=4]"),
    (dict(logprobs=-1), "logprobs", f"[0, {MAX_LOGPROBS}]"),
    (dict(logprobs=MAX_LOGPROBS + 1), "logprobs", f"[0, {MAX_LOGPROBS}]"),
    (dict(prompt_logprobs=MAX_LOGPROBS + 1), "prompt_logprobs", f"[0, {MAX_LOGPROBS}]"),
    (dict(stop=""), "stop", "non-empty strings"),
    (dict(stop=["ok", 3]), "stop", "non-empty strings"),
    (dict(stop=7), "stop", "a string or a list of strings"),
    (dict(stop_token_ids=[1, -1]), "stop_token_ids", ">= 0"),
    (dict(stop_token_ids=5), "stop_token_ids", "list of token ids"),
    (dict(logit_bias={1: 101}), "logit_bias", "[-100, 100]"),
    (dict(logit_bias={1: float("inf")}), "logit_bias", "[-100, 100]"),
    (dict(logit_bias={-1: 1}), "logit_bias", ">= 0"),
    (dict(logit_bias={"x": 1}), "logit_bias", ">= 0"),
    (dict(logit_bias={"\u00b2": 1}), "logit_bias", ">= 0"),  # isdigit() but no token id
    (dict(logit_bias=[1, 2]), "logit_bias", "dict"),
    (dict(output_kind="delta"), "output_kind", "DELTA"),
]


@pytest.mark.parametrize(
    "kwargs, field, allowed",
    INVALID,
    ids=[f"{case[1]}={list(case[0].values())[-1]!r}" for case in INVALID],
)
def test_invalid_values_name_the_field_and_the_range(kwargs, field, allowed):
    with pytest.raises(ValueError) as excinfo:
        SamplingParams(**kwargs)
    message = str(excinfo.value)
    assert message.startswith(f"{field} "), message
    assert allowed in message, message
    assert "got" in message, message  # the offending value is echoed back


def test_errors_are_value_errors_not_type_errors():
    # Comparisons on wrong types must not leak TypeError to API users (HTTP 400, not 500).
    for field in (
        "temperature",
        "top_p",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
    ):
        with pytest.raises(ValueError, match=re.escape(field)):
            SamplingParams(**{field: None})
