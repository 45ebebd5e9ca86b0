"""Shared fixtures: where ../shared is, and the real trained model in it."""

from __future__ import annotations

from pathlib import Path

import pytest

SHARED_DIR = Path(__file__).resolve().parent.parent.parent / "shared"


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    """../shared beside the project root; tests that need it skip when it is absent."""
    if not SHARED_DIR.is_dir():
        pytest.skip("../shared is not present")
    return SHARED_DIR


@pytest.fixture(scope="session")
def stories260k_path(shared_dir: Path) -> Path:
    """The trained stories260K Llama in HuggingFace format."""
    path = shared_dir / "models" / "stories260K"
    if not (path / "config.json").is_file():
        pytest.skip("stories260K is not present in ../shared/models")
    return path
