"""pytest plugin (entry point ``pytest11``): ``--octavo-platform NAME`` and the ``octavo_platform``
fixture the conformance suite runs against."""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("octavo")
    group.addoption(
        "--octavo-platform",
        default="cpu",
        help="platform whose kernels the conformance suite checks (default: cpu)",
    )


@pytest.fixture(scope="session")
def octavo_platform(request: pytest.FixtureRequest):
    """The platform named by ``--octavo-platform``, selected as at serve time."""
    from octavo.platform import Platform

    return Platform.select(device=request.config.getoption("--octavo-platform"))
