"""The cuda platform's detection: unavailable on this CPU build of torch unless emulation is
asked for explicitly, and then it computes on the CPU in the Triton interpreter."""

from __future__ import annotations

import torch

from octavo.platform import Platform
from octavo_cuda import plugin
from octavo_triton import runtime


def test_cpu_torch_reports_unavailable_with_the_emulation_hint(monkeypatch):
    if torch.version.cuda is not None:
        return  # a CUDA build: detection depends on the machine
    monkeypatch.delenv(runtime.INTERPRET_DEVICE_ENV, raising=False)
    info = plugin.octavo_platform_detect()
    assert not info.available
    assert runtime.INTERPRET_DEVICE_ENV in info.reason


def test_emulation_needs_the_interpreter_too(monkeypatch):
    monkeypatch.setenv(runtime.INTERPRET_DEVICE_ENV, "cuda")
    monkeypatch.setenv(runtime.INTERPRET_ENV, "0")
    assert not runtime.emulated("cuda")
    monkeypatch.setenv(runtime.INTERPRET_ENV, "1")
    assert runtime.emulated("cuda") and not runtime.emulated("rocm")


def test_emulated_platform_is_selectable_and_computes_on_the_cpu(monkeypatch):
    monkeypatch.setenv(runtime.INTERPRET_ENV, "1")
    monkeypatch.setenv(runtime.INTERPRET_DEVICE_ENV, "cuda")
    platform = Platform.select(device="cuda")
    assert platform.info.available and "Triton interpreter" in platform.info.reason
    assert platform.device_init(0) == torch.device("cpu")
    assert platform.capabilities.dist_backend == "gloo"
    assert platform.memory_info(torch.device("cpu")).total > 0
