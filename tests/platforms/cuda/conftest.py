"""Fixtures for the cuda platform's kernel tests: a real GPU, or the Triton interpreter.

Run here with ``TRITON_INTERPRET=1`` (the ``cuda-interpret`` CI leg); the platform is then
emulated on the CPU through ``OCTAVO_TRITON_INTERPRET_DEVICE=cuda``.
"""

from __future__ import annotations

import pytest
import torch

from octavo.platform import Platform
from octavo_triton import runtime

NAME = "cuda"


def pytest_collection_modifyitems(config, items):
    if runtime.interpreting() or (torch.version.cuda is not None and torch.cuda.is_available()):
        return
    skip = pytest.mark.skip(
        reason="needs a CUDA GPU or TRITON_INTERPRET=1 (the cuda-interpret leg)"
    )
    for item in items:
        if "needs_kernels" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def platform():
    """The cuda platform, selected as ``--device cuda`` would (emulated under the interpreter)."""
    with pytest.MonkeyPatch.context() as mp:
        if runtime.interpreting():
            mp.setenv(runtime.INTERPRET_DEVICE_ENV, NAME)
        yield Platform.select(device=NAME)


@pytest.fixture(scope="module")
def device(platform):
    """Where the kernels' tensors live: the GPU, or the CPU under the interpreter."""
    return platform.device_init(0)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "needs_kernels: runs Triton kernels (GPU or TRITON_INTERPRET=1)"
    )
