"""Hook implementations of the tpu platform (Google TPUs, JAX/Pallas kernels)."""

from __future__ import annotations

import glob
import importlib.util
import os

import torch

from octavo.platform import Capabilities, PlatformInfo, hookimpl
from octavo.platform.pending import kernel_pending

NAME = "tpu"
PRIORITY = 30


def _mine(platform: PlatformInfo) -> bool:
    return platform.name == NAME


def _why_unavailable() -> str | None:
    """None when a TPU runtime is present, else the reason. Never starts a TPU client: only
    device files and installed packages are looked at."""
    if importlib.util.find_spec("jax") is None:
        return "jax is not installed (pip install octavo[tpu])"
    if importlib.util.find_spec("libtpu") is None:
        return "libtpu is not installed: no TPU runtime (pip install 'jax[tpu]')"
    if not (
        glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*") or os.environ.get("TPU_NAME")
    ):
        return "no TPU device found (/dev/accel* or /dev/vfio/*)"
    return None


@hookimpl
def octavo_platform_detect() -> PlatformInfo:
    why = _why_unavailable()
    if why is not None:
        return PlatformInfo(NAME, "tpu", False, PRIORITY, why)
    return PlatformInfo(NAME, "tpu", True, PRIORITY, "TPU device files and libtpu present")


@hookimpl
def octavo_platform_capabilities(platform):
    if _mine(platform):
        return Capabilities(
            dtypes=(torch.float32, torch.bfloat16),
            block_sizes=(16, 32, 64, 128),
            supports_fp8=False,
            supports_graphs=True,
            dist_backend="xla",
            pin_host_memory=False,  # torch cannot pin for a TPU; JAX stages its own inputs
        )


def _pending(kernel: str):
    raise kernel_pending(
        NAME, kernel, "the Pallas kernels and JAX model runner land with the tpu issue"
    )


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
