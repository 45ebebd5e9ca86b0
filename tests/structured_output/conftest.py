"""Fixtures for structured output: the bundled demo model (never trained for JSON: only the
constraint makes its outputs valid), one torch thread for small shapes."""

from __future__ import annotations

from pathlib import Path

import pytest

import octavo

DEMO_MODEL = Path(octavo.__file__).resolve().parent / "data" / "demo-model"


@pytest.fixture(autouse=True, scope="session")
def _small_shapes_on_one_thread(one_torch_thread):
    """Every test here runs on one torch thread (``one_torch_thread`` in tests/conftest.py)."""


@pytest.fixture(scope="session")
def demo_llm():
    from octavo import LLM

    if not (DEMO_MODEL / "config.json").is_file():
        pytest.skip("the bundled demo model is not present")
    return LLM(str(DEMO_MODEL), kv_cache_memory="64MiB", max_num_seqs=64)
