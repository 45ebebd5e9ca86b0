"""Shared fixtures: one torch thread for tiny shapes, where ../shared is, and the real trained
model in it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

SHARED_DIR = Path(__file__).resolve().parent.parent.parent / "shared"


@pytest.fixture(scope="session")
def one_torch_thread():
    """Torch on one thread until the session ends. Tiny shapes gain nothing from threads, and on a
    shared 2-core machine OpenMP threads spinning against other processes make a tiny matmul ~30x
    slower. The engine, model, bench and server folders use it for every test (an autouse fixture
    in their conftest); once a test has used it, the rest of the session stays on one thread."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


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
