"""The rocm platform (AMD GPUs, Triton kernels tuned for CDNA): the entry point is :data:`PLUGIN`.

The hooks are the Triton GPU platforms' shared ones (:mod:`octavo_triton.gpu_platform`) with what
is AMD's own: HIP detection, wave64 tiles (:mod:`octavo_rocm.tuning`), and this platform's own
RMSNorm (:mod:`octavo_rocm.rms_norm`) and sampler (:mod:`octavo_rocm.sampler`). Without an AMD
GPU the platform can be emulated for testing: with ``TRITON_INTERPRET=1`` and
``OCTAVO_TRITON_INTERPRET_DEVICE=rocm`` it reports itself available and runs every kernel in the
Triton interpreter on CPU tensors.
"""

from __future__ import annotations

import torch

from octavo.platform import RMSNormFn, SamplerFn
from octavo_rocm.tuning import NUM_COMPUTE_UNITS, TUNING, WARP_SIZE
from octavo_triton import runtime
from octavo_triton.gpu_platform import GpuPlatform, TritonGpuPlugin
from octavo_triton.tuning import GpuTuning

NAME = "rocm"


def wrong_build() -> str | None:
    """Why this torch cannot drive AMD GPUs (not a ROCm build), or None."""
    if torch.version.hip is None:
        return (
            f"torch {torch.__version__} is not a ROCm build (torch.version.hip is None; "
            f"{runtime.emulation_hint(NAME)})"
        )
    return None


def make_rms_norm(hidden_size: int, eps: float, tuning: GpuTuning) -> RMSNormFn:
    """The persistent AITER-style RMSNorm: one program per compute unit walks the rows."""
    from octavo_rocm import rms_norm  # Triton kernels: imported when the platform runs

    return rms_norm.make_rms_norm(
        hidden_size, eps, tuning.rows.max_block, NUM_COMPUTE_UNITS, WARP_SIZE
    )


def make_sampler(vocab_size: int, tuning: GpuTuning) -> SamplerFn:
    """Split-vocabulary sampling for unfiltered batches (fills 304 compute units), the shared
    filtering kernel with wave64 chunks otherwise."""
    from octavo_rocm import sampler  # Triton kernels: imported when the platform runs

    return sampler.make_sampler(vocab_size, tuning.sampler)


PLUGIN = TritonGpuPlugin(
    GpuPlatform(
        NAME,
        devices="ROCm",  # ROCm builds of torch drive HIP devices through torch.cuda
        wrong_build=wrong_build,
        runtime=lambda: f"HIP {torch.version.hip}",
        visibility_hint="check /dev/kfd, /dev/dri and HIP_VISIBLE_DEVICES",
        tuning=TUNING,
        rms_norm=make_rms_norm,
        sampler=make_sampler,
    )
)
