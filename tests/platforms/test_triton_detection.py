"""The Triton GPU platforms' detection (cuda and rocm alike): unavailable on a torch build that
cannot drive their GPUs unless emulation is asked for explicitly, and then they compute on the
CPU in the Triton interpreter, with nothing pinned."""

from __future__ import annotations

import importlib

import pytest
import torch

from octavo.platform import Platform
from octavo_triton import runtime

NAMES = ("cuda", "rocm")


def plugin_of(name: str):
    return importlib.import_module(f"octavo_{name}.plugin").PLUGIN


@pytest.mark.parametrize("name", NAMES)
def test_a_build_without_the_gpu_reports_unavailable_with_the_emulation_hint(monkeypatch, name):
    plugin = plugin_of(name)
    if plugin.gpu.wrong_build() is None:
        pytest.skip(f"torch {torch.__version__} can drive {name} GPUs: detection depends on them")
    monkeypatch.delenv(runtime.INTERPRET_DEVICE_ENV, raising=False)
    info = plugin.octavo_platform_detect()
    assert not info.available and info.name == name and info.device_type == name
    assert runtime.INTERPRET_DEVICE_ENV in info.reason


@pytest.mark.parametrize("name", NAMES)
def test_emulation_needs_the_interpreter_too(monkeypatch, name):
    other = {"cuda": "rocm", "rocm": "cuda"}[name]
    monkeypatch.setenv(runtime.INTERPRET_DEVICE_ENV, name)
    monkeypatch.setenv(runtime.INTERPRET_ENV, "0")
    assert not runtime.emulated(name)
    monkeypatch.setenv(runtime.INTERPRET_ENV, "1")
    assert runtime.emulated(name) and not runtime.emulated(other)


@pytest.mark.parametrize("name", NAMES)
def test_emulated_platform_is_selectable_and_computes_on_the_cpu(monkeypatch, name):
    monkeypatch.setenv(runtime.INTERPRET_ENV, "1")
    monkeypatch.setenv(runtime.INTERPRET_DEVICE_ENV, name)
    platform = Platform.select(device=name)
    assert platform.info.available and "Triton interpreter" in platform.info.reason
    assert platform.device_init(0) == torch.device("cpu")
    assert platform.capabilities.dist_backend == "gloo"
    assert not platform.capabilities.pin_host_memory and not platform.capabilities.supports_graphs
    assert platform.memory_info(torch.device("cpu")).total > 0
