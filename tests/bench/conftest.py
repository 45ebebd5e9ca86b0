"""Fixtures for ``octavo bench`` tests: one tiny random Llama for the whole session."""

from __future__ import annotations

from pathlib import Path

import pytest

from octavo.testing.tiny_models import TinyModelSpec, write_tiny_model

TINY = TinyModelSpec(
    "LlamaForCausalLM",
    hidden_size=64,
    num_hidden_layers=2,
    vocab_size=512,
    max_position_embeddings=256,
    seed=5,
)


@pytest.fixture(autouse=True, scope="session")
def _tiny_shapes_on_one_thread(one_torch_thread):
    """Every test here runs on one torch thread (``one_torch_thread`` in tests/conftest.py)."""


@pytest.fixture(scope="session")
def bench_model(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("bench_tiny") / "llama", TINY)
