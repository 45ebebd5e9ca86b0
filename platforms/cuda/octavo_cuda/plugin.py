"""Hook implementations of the cuda platform (NVIDIA GPUs, Triton kernels).

The kernels come from ``octavo_triton`` with NVIDIA tile shapes (:mod:`octavo_cuda.tuning`).
Without a GPU the platform can be emulated for testing: with ``TRITON_INTERPRET=1`` and
``OCTAVO_TRITON_INTERPRET_DEVICE=cuda`` it reports itself available and runs every kernel in the
Triton interpreter on CPU tensors.
"""

from __future__ import annotations

import importlib.util

import psutil
import torch

from octavo import hookimpl
from octavo.platform.types import Capabilities, MemoryInfo, PlatformInfo
from octavo_cuda import tuning
from octavo_triton import runtime
from octavo_triton.attention import TritonAttentionBackend
from octavo_triton.bitmask import make_apply_token_bitmask
from octavo_triton.fp8 import make_scaled_mm
from octavo_triton.rejection_sampler import make_rejection_sampler
from octavo_triton.rms_norm import make_rms_norm
from octavo_triton.sampler import make_sampler

NAME = "cuda"
PRIORITY = 20


def _mine(platform: PlatformInfo) -> bool:
    return platform.name == NAME


def _emulated(platform: PlatformInfo) -> bool:
    return _mine(platform) and platform.device_type == "cpu"


def _why_unavailable() -> str | None:
    """None when an NVIDIA GPU can be used, else the reason. Never creates a CUDA context."""
    if torch.version.hip is not None:
        return f"torch {torch.__version__} is a ROCm build; use the rocm platform"
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is built without CUDA ({runtime.emulation_hint(NAME)})"
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install octavo[cuda])"
    if not torch.cuda.is_available():
        return "no CUDA device is visible (check the driver and CUDA_VISIBLE_DEVICES)"
    return None


@hookimpl
def octavo_platform_detect() -> PlatformInfo:
    if runtime.emulated(NAME):
        return PlatformInfo(NAME, "cpu", True, PRIORITY, runtime.emulation_reason(NAME))
    why = _why_unavailable()
    if why is not None:
        return PlatformInfo(NAME, "cuda", False, PRIORITY, why)
    count = torch.cuda.device_count()
    return PlatformInfo(
        NAME, "cuda", True, PRIORITY, f"{count} CUDA device(s), CUDA {torch.version.cuda}"
    )


@hookimpl
def octavo_platform_capabilities(platform):
    if _mine(platform):
        emulated = _emulated(platform)
        return Capabilities(
            dtypes=(torch.float32, torch.float16, torch.bfloat16),
            block_sizes=(1, 8, 16, 32, 64, 128),
            supports_fp8=True,
            supports_graphs=not emulated,
            dist_backend="gloo" if emulated else "nccl",
        )


@hookimpl
def octavo_device_init(platform, local_rank):
    if _mine(platform):
        if _emulated(platform):
            return torch.device("cpu")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)


@hookimpl
def octavo_memory_info(platform, device):
    if _mine(platform):
        if _emulated(platform):
            vm = psutil.virtual_memory()
            return MemoryInfo(total=vm.total, free=vm.available, used=vm.total - vm.available)
        free, total = torch.cuda.mem_get_info(device)
        return MemoryInfo(total=total, free=free, used=total - free)


class CudaAttentionBackend(TritonAttentionBackend):
    """Unified paged attention (prefill chunks and decodes in one launch) with NVIDIA tiles."""

    name = "cuda-triton"


@hookimpl
def octavo_attention_backend(platform, spec):
    if _mine(platform):
        return CudaAttentionBackend(spec, tuning.attention_tuning(spec))


@hookimpl
def octavo_rms_norm(platform, hidden_size, eps, dtype):
    if _mine(platform):
        return make_rms_norm(hidden_size, eps, tuning.ROWS)


@hookimpl
def octavo_sampler(platform, vocab_size):
    if _mine(platform):
        return make_sampler(vocab_size, tuning.SAMPLER)


@hookimpl
def octavo_apply_token_bitmask(platform):
    if _mine(platform):
        return make_apply_token_bitmask(tuning.ROWS)


@hookimpl
def octavo_scaled_mm(platform):
    if _mine(platform):
        widen = False
        if not _emulated(platform):
            major, minor = torch.cuda.get_device_capability()
            widen = major * 10 + minor < tuning.FP8_MMA_ARCH
        return make_scaled_mm(tuning.MATMUL, widen=widen)


@hookimpl
def octavo_rejection_sampler(platform):
    if _mine(platform):
        return make_rejection_sampler(tuning.SAMPLER)
