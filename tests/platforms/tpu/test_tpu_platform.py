"""Detection of the tpu platform: on a TPU host, or on any host under OCTAVO_PALLAS_INTERPRET=1,
and otherwise unavailable with the reason; `octavo env` shows which."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from octavo.errors import PlatformError
from octavo.platform import Platform, create_plugin_manager
from octavo.platform.selection import detect_platforms
from octavo_tpu import runtime

OCTAVO = Path(sys.executable).parent / "octavo"


def tpu_detection():
    return next(d.info for d in detect_platforms(create_plugin_manager()) if d.info.name == "tpu")


def test_without_a_tpu_or_the_interpreter_it_says_why_and_how(monkeypatch):
    monkeypatch.delenv(runtime.INTERPRET_ENV)
    tpu = tpu_detection()
    assert not tpu.available
    assert "libtpu" in tpu.reason or "no TPU device" in tpu.reason
    assert "OCTAVO_PALLAS_INTERPRET=1" in tpu.reason
    with pytest.raises(PlatformError, match="libtpu|no TPU device"):
        Platform.select("tpu")


def test_interpret_mode_makes_it_available_and_chosen():
    """As an emulated Triton platform is: the highest priority among those available."""
    tpu = tpu_detection()
    assert tpu.available and "interpret" in tpu.reason
    platform = Platform.select(None)
    assert platform.name == "tpu"
    assert platform.capabilities.dtypes == (torch.float32, torch.bfloat16)
    assert platform.device_init() == torch.device("cpu")


def test_octavo_env_shows_interpret_mode():
    env = {k: v for k, v in os.environ.items() if k != "OCTAVO_PLATFORM"}
    result = subprocess.run(
        [str(OCTAVO), "env"], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 0, result.stderr
    line = next(line for line in result.stdout.splitlines() if line.split()[:1] == ["tpu"])
    assert "Pallas interpret mode" in line and "unavailable" not in line
