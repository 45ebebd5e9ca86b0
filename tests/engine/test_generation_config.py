"""Request defaults from generation_config.json
(vLLM's --generation-config / --override-generation-config)."""

from __future__ import annotations

import argparse
import json
import shutil

import pytest
from engine_helpers import make_llm

from octavo import SamplingParams
from octavo.config import EngineArgs, json_object
from octavo.errors import ConfigError
from octavo.sampling_defaults import cap_max_tokens, load_sampling_defaults

PROMPT = [1, 17, 42, 99, 5]
RECOMMENDED = {
    "temperature": 0.7,
    "top_k": 1,
    "top_p": 0.9,
    "repetition_penalty": 1.3,
    "max_new_tokens": 6,
    "do_sample": True,
}


@pytest.fixture(scope="module")
def recommending_model(tiny_model, tmp_path_factory):
    """The tiny model with sampling recommendations in its generation_config.json."""
    folder = tmp_path_factory.mktemp("recommending") / "llama"
    shutil.copytree(tiny_model, folder)
    path = folder / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **RECOMMENDED}))
    return folder


def test_auto_takes_vllms_fields_and_renames_max_new_tokens():
    defaults = load_sampling_defaults("auto", {"eos_token_id": 2, **RECOMMENDED})
    assert defaults == {
        "temperature": 0.7,
        "top_k": 1,
        "top_p": 0.9,
        "repetition_penalty": 1.3,
        "max_tokens": 6,
    }
    assert load_sampling_defaults("vllm", RECOMMENDED) == {}
    assert load_sampling_defaults("vllm", RECOMMENDED, {"temperature": 0.2}) == {"temperature": 0.2}
    overridden = load_sampling_defaults(
        "auto", RECOMMENDED, {"temperature": 0.2, "max_new_tokens": None}
    )
    assert overridden["temperature"] == 0.2 and "max_tokens" not in overridden


def test_a_folder_is_read_and_a_folder_without_the_file_is_refused(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 0.5}))
    assert load_sampling_defaults(str(tmp_path), RECOMMENDED) == {"top_p": 0.5}
    with pytest.raises(ConfigError, match="has no generation_config.json; give a folder"):
        load_sampling_defaults(str(tmp_path / "missing"), {})


def test_invalid_recommendations_are_a_config_error_naming_the_fix():
    with pytest.raises(ConfigError, match="top_p.*--override-generation-config"):
        load_sampling_defaults("auto", {"top_p": 1.5})


def test_max_new_tokens_caps_but_does_not_raise_the_request_limit():
    assert cap_max_tokens(None, {"max_tokens": 6}) == 6
    assert cap_max_tokens(100, {"max_tokens": 6}) == 6
    assert cap_max_tokens(3, {"max_tokens": 6}) == 3
    assert cap_max_tokens(100, {}) == 100


def test_engine_args_check_the_flags():
    with pytest.raises(ConfigError, match="override_generation_config must be a dict"):
        EngineArgs(model="m", override_generation_config="temperature=0.5")
    with pytest.raises(ConfigError, match="generation_config must be"):
        EngineArgs(model="m", generation_config="")
    assert json_object('{"temperature": 0.5}') == {"temperature": 0.5}
    with pytest.raises(argparse.ArgumentTypeError, match="JSON object"):
        json_object("[0.5]")
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(
        ["--generation-config", "vllm", "--override-generation-config", '{"top_k": 3}']
    )
    assert EngineArgs.from_cli_args(args, model="m").override_generation_config == {"top_k": 3}


def test_offline_default_params_follow_the_model(recommending_model, tiny_model):
    llm = make_llm(recommending_model)
    params = llm.get_default_sampling_params()
    assert (
        params.temperature,
        params.top_k,
        params.top_p,
        params.repetition_penalty,
        params.max_tokens,
    ) == (
        0.7,
        1,
        0.9,
        1.3,
        6,
    )
    (output,) = llm.generate([{"prompt_token_ids": PROMPT}], use_tqdm=False)
    # top_k=1 is greedy whatever the temperature: the same as explicit greedy with the same penalty.
    greedy = SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=6)
    (expected,) = llm.generate([{"prompt_token_ids": PROMPT}], greedy, use_tqdm=False)
    assert (
        output.outputs[0].token_ids == expected.outputs[0].token_ids
        and len(expected.outputs[0].token_ids) == 6
    )
    # Explicit SamplingParams are taken as given, and "vllm" ignores the file.
    (explicit,) = llm.generate(
        [{"prompt_token_ids": PROMPT}],
        SamplingParams(temperature=0.0, max_tokens=9),
        use_tqdm=False,
    )
    assert len(explicit.outputs[0].token_ids) == 9
    assert (
        make_llm(recommending_model, generation_config="vllm").get_default_sampling_params()
        == SamplingParams()
    )
    assert make_llm(tiny_model).get_default_sampling_params() == SamplingParams()
