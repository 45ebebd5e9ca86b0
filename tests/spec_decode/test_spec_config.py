"""``speculative_config``: vLLM's dict checked at construction, every bad field named."""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil

import pytest
from spec_helpers import DRAFT

from octavo import LLM
from octavo.config import EngineArgs
from octavo.errors import ConfigError
from octavo.spec_decode import SpeculativeConfig
from octavo.testing.tiny_models import write_tiny_model


def test_the_dict_and_its_json_text_give_the_same_config():
    config = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 5}
    from_dict = EngineArgs(speculative_config=config).speculative_config
    assert from_dict == EngineArgs(speculative_config=json.dumps(config)).speculative_config
    # vLLM's rule: one lookup bound given stands for both
    assert (from_dict.prompt_lookup_min, from_dict.prompt_lookup_max) == (5, 5)
    assert EngineArgs().speculative_config is None
    default = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2})
    assert (default.prompt_lookup_min, default.prompt_lookup_max) == (5, 5)  # vLLM's


@pytest.mark.parametrize(
    "config, field",
    [
        ({"method": "medusa9", "num_speculative_tokens": 2}, "method"),
        ({"num_speculative_tokens": 2}, "method"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": "3"}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_min": 4,
                "prompt_lookup_max": 2,
            },
            "prompt_lookup_min",
        ),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 0}, "prompt_lookup"),
        ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel": 1}, "draft_"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
        ({"method": "draft_model", "num_speculative_tokens": 2, "model": "/no/such"}, "model"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0},
            "disable_by_batch_size",
        ),
    ],
)
def test_a_bad_field_is_a_config_error_naming_it(config, field):
    with pytest.raises(ConfigError, match=f"speculative_config.{field}"):
        EngineArgs(speculative_config=config)


def test_not_a_dict_is_refused():
    with pytest.raises(ConfigError, match="speculative_config"):
        EngineArgs(speculative_config=[("method", "ngram")])
    with pytest.raises(ConfigError, match="not valid JSON"):
        SpeculativeConfig.from_dict("{method: ngram")


def test_the_cli_flag_reads_vllm_json():
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(
        ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}']
    )
    config = EngineArgs.from_cli_args(args).speculative_config
    assert config == SpeculativeConfig("ngram", 3, prompt_lookup_min=5, prompt_lookup_max=5)


def _draft_config(path) -> dict:
    return {"method": "draft_model", "model": str(path), "num_speculative_tokens": 2}


def test_a_draft_model_of_another_vocabulary_is_refused(target_model, tmp_path):
    other = write_tiny_model(tmp_path / "other", dataclasses.replace(DRAFT, vocab_size=640))
    with pytest.raises(ConfigError, match="speculative_config.model has a vocabulary of 640"):
        LLM(str(target_model), kv_cache_memory="4MiB", speculative_config=_draft_config(other))


def test_a_draft_model_of_another_tokenizer_is_refused(target_model, draft_model, tmp_path):
    other = tmp_path / "retokenized"
    shutil.copytree(draft_model, other)
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[300:302]
    vocab[first], vocab[second] = vocab[second], vocab[first]  # same size, other ids
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ConfigError, match="tokenizer.json differs"):
        LLM(str(target_model), kv_cache_memory="4MiB", speculative_config=_draft_config(other))
