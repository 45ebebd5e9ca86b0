"""End to end on the cuda platform (the interpreter here): the greedy tokens of the cpu platform."""

from __future__ import annotations

import pytest

from octavo.testing.tiny_models import TinyModelSpec, write_tiny_model
from octavo_triton import kernel_checks as checks


@pytest.mark.needs_kernels
@pytest.mark.slow
def test_greedy_generation_matches_the_cpu_platform(tmp_path, monkeypatch):
    spec = TinyModelSpec(
        hidden_size=64, num_hidden_layers=2, vocab_size=512, max_position_embeddings=128, seed=7
    )
    checks.check_generation_matches_cpu(
        "cuda", write_tiny_model(tmp_path / "llama", spec), monkeypatch
    )
