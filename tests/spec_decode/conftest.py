"""Fixtures for speculative decoding: a tiny target, a smaller draft of its tokenizer, and one
torch thread for tiny shapes."""

from __future__ import annotations

from pathlib import Path

import pytest
from spec_helpers import DRAFT, TARGET  # a unique module name: every test folder has a conftest

from octavo.testing.tiny_models import write_tiny_model


@pytest.fixture(autouse=True, scope="session")
def _tiny_shapes_on_one_thread(one_torch_thread):
    """Every test here runs on one torch thread (``one_torch_thread`` in tests/conftest.py)."""


@pytest.fixture(scope="session")
def target_model(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("spec_target") / "llama", TARGET)


@pytest.fixture(scope="session")
def draft_model(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("spec_draft") / "llama", DRAFT)


@pytest.fixture(scope="session")
def eagle_head(tmp_path_factory, target_model) -> Path:
    """A random EAGLE head for the target (its drafts are nearly all rejected)."""
    from octavo.testing.tiny_models import write_random_eagle_head

    return write_random_eagle_head(tmp_path_factory.mktemp("spec_eagle") / "head", target_model)
