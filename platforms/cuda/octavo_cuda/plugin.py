"""The cuda platform (NVIDIA GPUs, Triton kernels): the entry point is :data:`PLUGIN`.

The hooks are the Triton GPU platforms' shared ones (:mod:`octavo_triton.gpu_platform`) with what
is NVIDIA's own: CUDA detection, NVIDIA tiles (:mod:`octavo_cuda.tuning`) and FP8 widened to
float16 on chips older than Ada. Without a GPU the platform can be emulated for testing: with
``TRITON_INTERPRET=1`` and ``OCTAVO_TRITON_INTERPRET_DEVICE=cuda`` it reports itself available and
runs every kernel in the Triton interpreter on CPU tensors.
"""

from __future__ import annotations

import torch

from octavo_cuda.tuning import FP8_MMA_ARCH, TUNING
from octavo_triton import runtime
from octavo_triton.gpu_platform import GpuPlatform, TritonGpuPlugin

NAME = "cuda"


def wrong_build() -> str | None:
    """Why this torch cannot drive NVIDIA GPUs (a ROCm or CPU-only build), or None."""
    if torch.version.hip is not None:
        return f"torch {torch.__version__} is a ROCm build; use the rocm platform"
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is built without CUDA ({runtime.emulation_hint(NAME)})"
    return None


def widen_fp8() -> bool:
    """Ampere (sm_80/86) has no FP8 tensor cores: e4m3 operands are widened to float16."""
    major, minor = torch.cuda.get_device_capability()
    return major * 10 + minor < FP8_MMA_ARCH


PLUGIN = TritonGpuPlugin(
    GpuPlatform(
        NAME,
        devices="CUDA",
        wrong_build=wrong_build,
        runtime=lambda: f"CUDA {torch.version.cuda}",
        visibility_hint="check the driver and CUDA_VISIBLE_DEVICES",
        tuning=TUNING,
        widen_fp8=widen_fp8,
    )
)
