"""Hook implementations of the cuda platform (NVIDIA GPUs, Triton kernels)."""

from __future__ import annotations

import importlib.util

import torch

from octavo import hookimpl
from octavo.platform.pending import kernel_pending
from octavo.platform.types import Capabilities, MemoryInfo, PlatformInfo

NAME = "cuda"
PRIORITY = 20


def _mine(platform: PlatformInfo) -> bool:
    return platform.name == NAME


def _why_unavailable() -> str | None:
    """None when an NVIDIA GPU can be used, else the reason. Never creates a CUDA context."""
    if torch.version.hip is not None:
        return f"torch {torch.__version__} is a ROCm build; use the rocm platform"
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is built without CUDA"
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install octavo[cuda])"
    if not torch.cuda.is_available():
        return "no CUDA device is visible (check the driver and CUDA_VISIBLE_DEVICES)"
    return None


@hookimpl
def octavo_platform_detect() -> PlatformInfo:
    why = _why_unavailable()
    if why is not None:
        return PlatformInfo(NAME, "cuda", False, PRIORITY, why)
    count = torch.cuda.device_count()
    return PlatformInfo(NAME, "cuda", True, PRIORITY, f"{count} CUDA device(s), CUDA {torch.version.cuda}")


@hookimpl
def octavo_platform_capabilities(platform):
    if _mine(platform):
        return Capabilities(
            dtypes=(torch.float32, torch.float16, torch.bfloat16),
            block_sizes=(16, 32, 64, 128),
            supports_fp8=True,
            supports_graphs=True,
            dist_backend="nccl",
        )


@hookimpl
def octavo_device_init(platform, local_rank):
    if _mine(platform):
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)


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
