"""pytest plugin (entry point ``pytest11``): ``--octavo-platform NAME`` and the fixtures the
conformance suite runs against.

    pytest --pyargs octavo.testing.conformance --octavo-platform NAME [--octavo-plugin MODULE ...]

``--octavo-plugin`` registers extra in-process plugin modules beside the installed ones, the way
a kernel pack (a ``tryfirst`` plugin answering for an existing platform) is checked before it is
packaged; the suite's own test of the test uses it to load deliberately wrong kernels.
"""

from __future__ import annotations

import importlib

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("octavo")
    group.addoption(
        "--octavo-platform",
        default="cpu",
        help="platform whose kernels the conformance suite checks (default: cpu)",
    )
    group.addoption(
        "--octavo-plugin",
        action="append",
        default=[],
        metavar="MODULE",
        help="import MODULE and register it as an extra octavo plugin (repeatable), "
        "e.g. a kernel pack under test",
    )
    group.addoption(
        "--octavo-conformance-quick",
        action="store_true",
        default=False,
        help="run a reduced conformance matrix (for slow back-ends such as TRITON_INTERPRET=1)",
    )


@pytest.fixture(scope="session")
def octavo_platform(request: pytest.FixtureRequest):
    """The platform named by ``--octavo-platform``, selected as at serve time (plus any
    ``--octavo-plugin`` modules)."""
    from octavo.platform import Platform
    from octavo.platform.manager import create_plugin_manager

    names = request.config.getoption("--octavo-plugin")
    extra = [(name, importlib.import_module(name)) for name in names]
    pm = create_plugin_manager(plugins=extra)
    return Platform.select(device=request.config.getoption("--octavo-platform"), pm=pm)


@pytest.fixture(scope="session")
def octavo_device(octavo_platform):
    """The device the platform computes on (``platform.device_init()``); conformance inputs
    are created there."""
    return octavo_platform.device_init()


@pytest.fixture(scope="session")
def octavo_conformance_quick(request: pytest.FixtureRequest) -> bool:
    """True under ``--octavo-conformance-quick``: tests trim their matrices."""
    return bool(request.config.getoption("--octavo-conformance-quick"))
