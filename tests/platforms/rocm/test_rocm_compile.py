"""Every rocm kernel, with the rocm platform's own tiles, compiles to an hsaco for gfx942 (MI300).

The interpreter cannot see chip constraints (MFMA shapes, operand types, the 64 KiB LDS); the
real Triton pipeline with its built-in LLVM linker can, without a GPU. Runs in a subprocess
because the kernels must be JITFunctions, which they are not under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from octavo_rocm import compile_check


@pytest.mark.slow
def test_kernels_compile_for_gfx942():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-m", "octavo_rocm.compile_check", "--arch", "gfx942"],
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    built = [line for line in result.stdout.splitlines() if line.startswith("hip:gfx942")]
    assert len(built) == len(compile_check.builds()), result.stdout
    assert all("amdgcn+hsaco" in line for line in built), result.stdout
