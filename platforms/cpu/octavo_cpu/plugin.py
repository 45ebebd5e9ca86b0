"""Hook implementations of the cpu platform."""

from __future__ import annotations

import psutil
import torch

from octavo import hookimpl
from octavo.ops import reference
from octavo.platform.types import (
    AttentionBackend,
    Capabilities,
    MemoryInfo,
    PlatformInfo,
)

NAME = "cpu"


def _mine(platform: PlatformInfo) -> bool:
    return platform.name == NAME


class CpuAttentionBackend(AttentionBackend):
    """Paged attention on the host CPU."""

    name = "cpu"

    def forward(self, query, key, value, kv_cache, metadata):
        return reference.paged_attention(
            query, key, value, kv_cache, metadata, self.spec.scale, self.spec.sliding_window
        )


@hookimpl
def octavo_platform_detect() -> PlatformInfo:
    return PlatformInfo(
        name=NAME,
        device_type="cpu",
        available=True,
        priority=0,
        reason=f"always available: torch {torch.__version__} on {psutil.cpu_count()} CPU cores",
    )


@hookimpl
def octavo_platform_capabilities(platform):
    if _mine(platform):
        return Capabilities(
            dtypes=(torch.float32, torch.bfloat16),
            block_sizes=(1, 8, 16, 32, 64, 128),
            supports_fp8=False,
            supports_graphs=False,
            dist_backend="gloo",
        )


@hookimpl
def octavo_device_init(platform, local_rank):
    if _mine(platform):
        return torch.device("cpu")


@hookimpl
def octavo_memory_info(platform, device):
    if _mine(platform):
        vm = psutil.virtual_memory()
        return MemoryInfo(total=vm.total, free=vm.available, used=vm.total - vm.available)


@hookimpl
def octavo_attention_backend(platform, spec):
    if _mine(platform):
        return CpuAttentionBackend(spec)


@hookimpl
def octavo_rms_norm(platform, hidden_size, eps, dtype):
    if _mine(platform):
        def rms_norm(x, weight, residual=None):
            return reference.rms_norm(x, weight, eps, residual)

        return rms_norm


@hookimpl
def octavo_sampler(platform, vocab_size):
    if _mine(platform):
        return reference.sample


@hookimpl
def octavo_apply_token_bitmask(platform):
    if _mine(platform):
        return reference.apply_token_bitmask
