"""The tpu platform before its kernels land: honest detection and a clear error for kernels."""

from __future__ import annotations

import pytest
import torch

from octavo.errors import KernelNotAvailableError
from octavo.platform import Platform, PlatformInfo, create_plugin_manager
from octavo.platform.selection import Detection, Selection, detect_platforms


def test_detection_says_why_no_tpu_is_usable_here():
    tpu = next(d.info for d in detect_platforms(create_plugin_manager()) if d.info.name == "tpu")
    assert not tpu.available
    assert "libtpu" in tpu.reason or "no TPU device" in tpu.reason


def test_asking_for_a_kernel_says_it_is_not_there_yet():
    pm = create_plugin_manager()
    pretend = Detection("tpu", PlatformInfo("tpu", "tpu", True, 30, "pretend"))
    platform = Platform(pm, Selection(pretend, "test", (pretend,)))
    assert platform.capabilities.dist_backend == "xla"
    with pytest.raises(KernelNotAvailableError, match="tpu platform has no RMSNorm kernel yet"):
        platform.rms_norm(64, 1e-6, torch.float32)
