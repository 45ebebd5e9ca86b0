"""Hook implementations of the rocm platform (AMD GPUs, Triton kernels tuned for CDNA).

Attention and the token bitmask are the shared ``octavo_triton`` kernels with wave64 tiles
(:mod:`octavo_rocm.tuning`); RMSNorm (:mod:`octavo_rocm.rms_norm`) and the sampler
(:mod:`octavo_rocm.sampler`) are this platform's own. Without an AMD GPU the platform can be
emulated for testing: with ``TRITON_INTERPRET=1`` and ``OCTAVO_TRITON_INTERPRET_DEVICE=rocm`` it
reports itself available and runs every kernel in the Triton interpreter on CPU tensors.
"""

from __future__ import annotations

import importlib.util

import psutil
import torch

from octavo import hookimpl
from octavo.platform.types import Capabilities, MemoryInfo, PlatformInfo
from octavo_rocm import rms_norm, sampler, tuning
from octavo_triton import runtime
from octavo_triton.attention import TritonAttentionBackend
from octavo_triton.bitmask import make_apply_token_bitmask
from octavo_triton.fp8 import make_scaled_mm
from octavo_triton.rejection_sampler import make_rejection_sampler

NAME = "rocm"
PRIORITY = 20


def _mine(platform: PlatformInfo) -> bool:
    return platform.name == NAME


def _emulated(platform: PlatformInfo) -> bool:
    return _mine(platform) and platform.device_type == "cpu"


def _why_unavailable() -> str | None:
    """None when an AMD GPU can be used, else the reason. Never creates a HIP context."""
    if torch.version.hip is None:
        return (
            f"torch {torch.__version__} is not a ROCm build (torch.version.hip is None; "
            f"{runtime.emulation_hint(NAME)})"
        )
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install octavo[rocm])"
    if not torch.cuda.is_available():
        return "no ROCm device is visible (check /dev/kfd, /dev/dri and HIP_VISIBLE_DEVICES)"
    return None


@hookimpl
def octavo_platform_detect() -> PlatformInfo:
    if runtime.emulated(NAME):
        return PlatformInfo(NAME, "cpu", True, PRIORITY, runtime.emulation_reason(NAME))
    why = _why_unavailable()
    if why is not None:
        return PlatformInfo(NAME, "rocm", False, PRIORITY, why)
    count = torch.cuda.device_count()
    return PlatformInfo(
        NAME, "rocm", True, PRIORITY, f"{count} ROCm device(s), HIP {torch.version.hip}"
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
            dist_backend="gloo" if emulated else "nccl",  # torch names RCCL "nccl" on ROCm
        )


@hookimpl
def octavo_device_init(platform, local_rank):
    if _mine(platform):
        if _emulated(platform):
            return torch.device("cpu")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)  # ROCm builds of torch name HIP devices "cuda"


@hookimpl
def octavo_memory_info(platform, device):
    if _mine(platform):
        if _emulated(platform):
            vm = psutil.virtual_memory()
            return MemoryInfo(total=vm.total, free=vm.available, used=vm.total - vm.available)
        free, total = torch.cuda.mem_get_info(device)
        return MemoryInfo(total=total, free=free, used=total - free)


class RocmAttentionBackend(TritonAttentionBackend):
    """Unified paged attention (prefill chunks and decodes in one launch) with CDNA tiles."""

    name = "rocm-triton"


@hookimpl
def octavo_attention_backend(platform, spec):
    if _mine(platform):
        return RocmAttentionBackend(spec, tuning.attention_tuning(spec))


@hookimpl
def octavo_rms_norm(platform, hidden_size, eps, dtype):
    if _mine(platform):
        return rms_norm.make_rms_norm(
            hidden_size, eps, tuning.ROWS.max_block, tuning.NUM_COMPUTE_UNITS, tuning.WARP_SIZE
        )


@hookimpl
def octavo_sampler(platform, vocab_size):
    if _mine(platform):
        return sampler.make_sampler(vocab_size, tuning.SAMPLER)


@hookimpl
def octavo_apply_token_bitmask(platform):
    if _mine(platform):
        return make_apply_token_bitmask(tuning.ROWS)


@hookimpl
def octavo_scaled_mm(platform):
    if _mine(platform):
        return make_scaled_mm(tuning.MATMUL)


@hookimpl
def octavo_rejection_sampler(platform):
    if _mine(platform):
        return make_rejection_sampler(tuning.SAMPLER)
