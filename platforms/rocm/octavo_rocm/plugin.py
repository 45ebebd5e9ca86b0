"""Hook implementations of the rocm platform (AMD GPUs, Triton kernels tuned for CDNA)."""

from __future__ import annotations

import importlib.util

import torch

from octavo import hookimpl
from octavo.platform.pending import kernel_pending
from octavo.platform.types import Capabilities, MemoryInfo, PlatformInfo

NAME = "rocm"
PRIORITY = 20


def _mine(platform: PlatformInfo) -> bool:
    return platform.name == NAME


def _why_unavailable() -> str | None:
    """None when an AMD GPU can be used, else the reason. Never creates a HIP context."""
    if torch.version.hip is None:
        return f"torch {torch.__version__} is not a ROCm build (torch.version.hip is None)"
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install octavo[rocm])"
    if not torch.cuda.is_available():
        return "no ROCm device is visible (check /dev/kfd, /dev/dri and HIP_VISIBLE_DEVICES)"
    return None


@hookimpl
def octavo_platform_detect() -> PlatformInfo:
    why = _why_unavailable()
    if why is not None:
        return PlatformInfo(NAME, "rocm", False, PRIORITY, why)
    count = torch.cuda.device_count()
    return PlatformInfo(NAME, "rocm", True, PRIORITY, f"{count} ROCm device(s), HIP {torch.version.hip}")


@hookimpl
def octavo_platform_capabilities(platform):
    if _mine(platform):
        return Capabilities(
            dtypes=(torch.float32, torch.float16, torch.bfloat16),
            block_sizes=(16, 32, 64, 128),
            supports_fp8=True,
            supports_graphs=True,
            dist_backend="rccl",
        )


@hookimpl
def octavo_device_init(platform, local_rank):
    if _mine(platform):
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)  # ROCm builds of torch name HIP devices "cuda"


@hookimpl
def octavo_memory_info(platform, device):
    if _mine(platform):
        free, total = torch.cuda.mem_get_info(device)
        return MemoryInfo(total=total, free=free, used=total - free)


def _pending(kernel: str):
    raise kernel_pending(NAME, kernel, "the Triton kernels land with the cuda/rocm issue")


@hookimpl
def octavo_attention_backend(platform, spec):
    if _mine(platform):
        _pending("paged attention")


@hookimpl
def octavo_rms_norm(platform, hidden_size, eps, dtype):
    if _mine(platform):
        _pending("RMSNorm")


@hookimpl
def octavo_sampler(platform, vocab_size):
    if _mine(platform):
        _pending("sampler")
