"""MTP: a checkpoint's own multi-token-prediction layer drafts (losslessness is in
test_spec_lossless and test_spec_distribution); a target that declares none, or another model
named, is refused; serving without the mtp method leaves the layer unloaded."""

from __future__ import annotations

import dataclasses
import logging

import pytest
from spec_helpers import TARGET, make_llm, mtp

from octavo.errors import ConfigError
from octavo.spec_decode.mtp import MtpHead
from octavo.testing.tiny_models import write_tiny_model


def test_the_mtp_head_loads_the_checkpoints_layer_past_the_stack(target_model):
    llm = make_llm(target_model, mtp(2))
    proposer = llm.engine.core.runner.speculation.proposer
    assert isinstance(proposer.model, MtpHead)
    assert proposer.model.prefix == f"model.layers.{TARGET.num_hidden_layers}."
    assert len(proposer.attention_layers) == 1


def test_a_target_with_mtp_layers_serves_without_them_quietly(target_model, caplog):
    with caplog.at_level(logging.WARNING):
        llm = make_llm(target_model)
    assert llm.engine.core.runner.speculation is None
    assert "ignored" not in caplog.text


def test_a_target_without_mtp_layers_is_refused(tmp_path):
    plain = write_tiny_model(tmp_path / "plain", dataclasses.replace(TARGET, seed=5))
    with pytest.raises(ConfigError, match="has no MTP layers.*num_nextn_predict_layers"):
        make_llm(plain, mtp(2))


def test_another_model_named_is_refused(target_model, draft_model):
    with pytest.raises(ConfigError, match="is not the target"):
        make_llm(target_model, mtp(2, model=str(draft_model)))
    with pytest.raises(ConfigError, match="not a model folder"):
        make_llm(target_model, mtp(2, model="/nonexistent"))
