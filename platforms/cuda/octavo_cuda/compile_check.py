"""Compile the cuda platform's kernels, with its own tuning, for sm_80 and sm_90 (no GPU needed).

    python -m octavo_cuda.compile_check [--arch 80 --arch 90]

Runs without ``TRITON_INTERPRET``; exits non-zero naming the first kernel that fails.
"""

from __future__ import annotations

import sys

from triton.backends.compiler import GPUTarget

from octavo_cuda.tuning import FP8_MMA_ARCH, TUNING
from octavo_triton import compile_check as cc


def builds(arch: int = 90) -> list[cc.KernelBuild]:
    """Every kernel the cuda platform launches on ``arch``, in the specialisations models use."""
    out = cc.model_attention_builds(TUNING)
    for dtype in cc.DTYPES:
        out += cc.rms_norm_builds(4096, dtype, TUNING.rows)
    out += cc.sampler_builds(TUNING.sampler)
    out += cc.rejection_sampler_builds(TUNING.sampler)
    out += cc.bitmask_builds(TUNING.rows)
    out += cc.fp8_builds(TUNING.matmul, "fp8e4nv", widen=arch < FP8_MMA_ARCH)
    return out


def main(argv=None) -> int:
    return cc.main(
        argv, __doc__, [80, 90], lambda arch: GPUTarget("cuda", arch, 32), builds, arch_type=int
    )


if __name__ == "__main__":
    sys.exit(main())
