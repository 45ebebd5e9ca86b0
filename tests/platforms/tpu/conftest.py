"""The tpu platform's tests run in Pallas interpret mode on the CPU: every test here sees
``OCTAVO_PALLAS_INTERPRET=1`` (the tpu-interpret CI leg sets it too), except where a test
removes it to check detection without it. The variables are set for each module and removed
after it, so that tests of other folders run in the same pytest process (``tests/engine``)
still detect the cpu platform."""

from __future__ import annotations

import pytest

pytest.importorskip("jax")

from octavo_tpu import runtime  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _pallas_interpret():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(runtime.INTERPRET_ENV, "1")
        mp.setenv("JAX_PLATFORMS", "cpu")
        yield


@pytest.fixture(autouse=True, scope="session")
def _tiny_shapes_on_one_thread(one_torch_thread):
    """The cpu-platform oracles run on one torch thread (tests/conftest.py)."""
