"""The hooks a vendor platform implements. Only public octavo API is used: ``octavo.platform``
(the ``hookimpl`` marker and the contract's types) and ``octavo.ops.reference``. A real vendor
replaces the kernels.

Every hook except detection answers only when ``platform.name`` is this platform's, and returns
None otherwise ("not me"), so the plugin can be installed beside any other.
"""

from __future__ import annotations

import os

import psutil
import torch

from octavo.ops import reference
from octavo.platform import AttentionBackend, Capabilities, MemoryInfo, PlatformInfo, hookimpl

NAME = "example"
DEVICE_ENV = "OCTAVO_EXAMPLE_NPU"


def _mine(platform: PlatformInfo) -> bool:
    return platform.name == NAME


class ExampleAttentionBackend(AttentionBackend):
    """Paged attention for the Example NPU (here: the reference kernel on the host)."""

    name = "example"

    def forward(self, query, key, value, kv_cache, metadata):
        return reference.paged_attention(
            query, key, value, kv_cache, metadata, self.spec.scale, self.spec.sliding_window
        )


@hookimpl
def octavo_platform_detect() -> PlatformInfo:
    # Detection must be cheap and must not start a device runtime: look at files or env only.
    present = os.environ.get(DEVICE_ENV, "") not in ("", "0")
    reason = (
        f"Example NPU emulated on the CPU ({DEVICE_ENV} is set)"
        if present
        else f"no Example NPU found (set {DEVICE_ENV}=1 to emulate one on the CPU)"
    )
    return PlatformInfo(NAME, "cpu", present, 10, reason)


@hookimpl
def octavo_platform_capabilities(platform):
    if _mine(platform):
        # An NPU with memory of its own would pin host staging buffers (pin_host_memory=True);
        # this one computes on the host.
        return Capabilities(
            dtypes=(torch.float32,), block_sizes=(1, 16, 32, 128), pin_host_memory=False
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
        return ExampleAttentionBackend(spec)


@hookimpl
def octavo_rms_norm(platform, hidden_size, eps, dtype):
    if _mine(platform):
        return lambda x, weight, residual=None: reference.rms_norm(x, weight, eps, residual)


@hookimpl
def octavo_sampler(platform, vocab_size):
    if _mine(platform):
        return reference.sample


@hookimpl
def octavo_apply_token_bitmask(platform):
    if _mine(platform):
        return reference.apply_token_bitmask


@hookimpl
def octavo_fused_moe(platform, spec):
    """Mixture-of-Experts layers (optional: without this hook the core runs the same reference).
    ``pack(w13, w2)`` is called once per layer at load, where a vendor lays the experts out for
    its grouped GEMM; the function it returns routes a step's tokens and applies their experts
    in one call. Here: the reference loop over the step's experts, weights as they are."""
    if _mine(platform):
        return lambda w13, w2: reference.pack_fused_moe(spec, w13, w2)
