"""Fixtures for the LoRA tests: a tiny random Llama, and PEFT adapters of it of different
ranks and target sets (one rsLoRA), saved by PEFT itself."""

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
    seed=7,
)
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# name: (rank, alpha, target modules, rsLoRA)
ADAPTERS = {
    "attn-r4": (4, 8, ("q_proj", "v_proj"), False),
    "mlp-r8": (8, 16, ("gate_proj", "up_proj", "down_proj"), False),
    "all-r16": (16, 32, ALL, False),
    "kvo-r8-rslora": (8, 4, ("k_proj", "o_proj", "down_proj"), True),
}


@pytest.fixture(autouse=True, scope="session")
def _tiny_shapes_on_one_thread(one_torch_thread):
    """Every test here runs on one torch thread (``one_torch_thread`` in tests/conftest.py)."""


@pytest.fixture(scope="session")
def base_model(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("lora_base") / "llama", TINY)


@pytest.fixture(scope="session")
def adapters(base_model, tmp_path_factory) -> dict[str, Path]:
    """Each of ADAPTERS as a PEFT folder of ``base_model``."""
    pytest.importorskip("peft", reason="the LoRA oracle is PEFT (pip install peft)")
    from octavo.testing.tiny_lora import write_random_lora

    root = tmp_path_factory.mktemp("lora_adapters")
    return {
        name: write_random_lora(
            root / name,
            base_model,
            rank=rank,
            alpha=alpha,
            target_modules=targets,
            use_rslora=rslora,
            seed=i + 1,
        )
        for i, (name, (rank, alpha, targets, rslora)) in enumerate(ADAPTERS.items())
    }
