"""Fixtures for tensor-parallel tests: tiny models of several shapes (GQA, KV heads fewer than
the ranks, tied and untied heads, Qwen2's biases)."""

from __future__ import annotations

from pathlib import Path

import pytest

from octavo.testing.tiny_models import TinyModelSpec, write_tiny_model

SHAPES = {
    "gqa-untied": TinyModelSpec("LlamaForCausalLM", num_attention_heads=4, num_key_value_heads=2),
    "kv1-tied": TinyModelSpec(
        "LlamaForCausalLM", num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True
    ),
    "qwen2-mha": TinyModelSpec(
        "Qwen2ForCausalLM", num_attention_heads=4, num_key_value_heads=4, vocab_size=501, seed=3
    ),
}


@pytest.fixture(scope="session")
def tp_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp_models")
    return {name: write_tiny_model(root / name, spec) for name, spec in SHAPES.items()}
