"""Every cuda kernel, with the cuda platform's own tiles, compiles to a cubin for sm_80 and sm_90.

The interpreter cannot see chip constraints (dot shapes, operand types, shared memory); the real
Triton pipeline with the bundled ptxas can, without a GPU. Runs in a subprocess because the
kernels must be JITFunctions, which they are not under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from octavo_cuda import compile_check


@pytest.mark.slow
def test_kernels_compile_for_sm80_and_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-m", "octavo_cuda.compile_check", "--arch", "80", "--arch", "90"],
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    lines = result.stdout.splitlines()
    for arch in ("cuda:80", "cuda:90"):
        built = [line for line in lines if line.startswith(arch)]
        assert len(built) == len(compile_check.builds(int(arch[-2:]))), (
            f"{arch}: only\n{result.stdout}"
        )
        assert all("ptx+cubin" in line for line in built), result.stdout
