"""`octavo env`: every plugin, its distribution, what it detected and why, and the choice."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

OCTAVO = Path(sys.executable).parent / "octavo"


def run_env(*args: str, **env: str) -> subprocess.CompletedProcess:
    full_env = {
        k: v for k, v in os.environ.items() if k not in ("OCTAVO_PLATFORM", "OCTAVO_EXAMPLE_NPU")
    }
    full_env.update(env)
    return subprocess.run(
        [str(OCTAVO), "env", *args], capture_output=True, text=True, env=full_env, timeout=120
    )


def test_env_lists_every_platform_with_distribution_and_reason():
    result = run_env()
    assert result.returncode == 0, result.stderr
    lines = {line.split()[0]: line for line in result.stdout.splitlines() if line.startswith("  ")}
    for name, dist in [
        ("cpu", "octavo-cpu"),
        ("cuda", "octavo-cuda"),
        ("rocm", "octavo-rocm"),
        ("tpu", "octavo-tpu"),
        ("example", "octavo-example-platform"),
    ]:
        assert dist in lines[name]
    assert "available" in lines["cpu"] and "unavailable" not in lines["cpu"]
    assert "unavailable" in lines["example"] and "OCTAVO_EXAMPLE_NPU" in lines["example"]
    assert "without CUDA" in lines["cuda"]
    assert "chosen: cpu (highest priority" in result.stdout


def test_env_reports_a_forced_choice_and_a_failing_one():
    forced = run_env(OCTAVO_EXAMPLE_NPU="1", OCTAVO_PLATFORM="cpu")
    assert "chosen: cpu (requested by OCTAVO_PLATFORM)" in forced.stdout
    failing = run_env("--device", "rocm")
    assert failing.returncode == 0
    assert "chosen: none: platform 'rocm' was requested but is not available" in failing.stdout


def test_octavo_makes_idle_openmp_threads_sleep_unless_told_otherwise():
    """Spinning OpenMP threads collapse throughput when anything else wants a core."""
    environment = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    default = subprocess.run(
        [str(OCTAVO), "env"], capture_output=True, text=True, env=environment, timeout=120
    )
    assert "OMP_WAIT_POLICY=PASSIVE" in default.stdout
    assert "OMP_WAIT_POLICY=ACTIVE" in run_env(OMP_WAIT_POLICY="ACTIVE").stdout
