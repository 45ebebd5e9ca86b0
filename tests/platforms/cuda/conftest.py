"""The cuda folder: its platform's name for the fixtures of ``tests/platforms/conftest.py``."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def platform_name() -> str:
    return "cuda"
