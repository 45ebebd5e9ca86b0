"""Fixtures for speculative decoding: a tiny target, a smaller draft of its tokenizer, and one
torch thread for tiny shapes."""

from __future__ import annotations

from pathlib import Path

import pytest
from spec_helpers import DRAFT, TARGET  # a unique module name: every test folder has a conftest

from octavo.testing.tiny_models import add_random_mtp_layer, write_tiny_model


@pytest.fixture(autouse=True, scope="session")
def _tiny_shapes_on_one_thread(one_torch_thread):
    """Every test here runs on one torch thread (``one_torch_thread`` in tests/conftest.py)."""


@pytest.fixture(scope="session")
def target_model(tmp_path_factory) -> Path:
    """The tiny target, with one random MTP layer after its decoder stack (which serving
    without the mtp method leaves unloaded)."""
    folder = write_tiny_model(tmp_path_factory.mktemp("spec_target") / "llama", TARGET)
    return add_random_mtp_layer(folder)


@pytest.fixture(scope="session")
def draft_model(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("spec_draft") / "llama", DRAFT)


@pytest.fixture(scope="session")
def eagle_head(tmp_path_factory, target_model) -> Path:
    """A random EAGLE head for the target (its drafts are nearly all rejected)."""
    from octavo.testing.tiny_models import write_random_eagle_head

    return write_random_eagle_head(tmp_path_factory.mktemp("spec_eagle") / "head", target_model)


@pytest.fixture(scope="session")
def p_eagle_head(tmp_path_factory, target_model) -> Path:
    """A random P-EAGLE head (an EAGLE head with mask inputs) for the target."""
    from octavo.testing.tiny_models import write_random_eagle_head

    folder = tmp_path_factory.mktemp("spec_p_eagle") / "head"
    return write_random_eagle_head(folder, target_model, seed=1, parallel_drafting=True)


@pytest.fixture(scope="session")
def two_layer_p_eagle_head(tmp_path_factory, target_model) -> Path:
    """A random P-EAGLE head of two decoder layers (a later layer's masked slots read the first
    layer's outputs at the slots before them)."""
    from octavo.testing.tiny_models import write_random_eagle_head

    folder = tmp_path_factory.mktemp("spec_p_eagle_2") / "head"
    return write_random_eagle_head(folder, target_model, seed=3, parallel_drafting=True, layers=2)


@pytest.fixture(scope="session")
def gumiho_head(tmp_path_factory, target_model) -> Path:
    """A random Gumiho head (2 serial drafts, 3 MLP heads) for the target."""
    from octavo.testing.tiny_models import write_random_gumiho_head

    folder = tmp_path_factory.mktemp("spec_gumiho") / "head"
    return write_random_gumiho_head(folder, target_model, num_parallel_heads=3, seed=2)
