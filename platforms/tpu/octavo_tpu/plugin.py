"""Hook implementations of the tpu platform (Google TPUs: a JAX model runner, Pallas kernels).

The engine runs the model through the platform's own runner (``octavo_model_runner``); the
torch-facing kernel hooks wrap the same Pallas kernels for the conformance suite.
``OCTAVO_PALLAS_INTERPRET=1`` runs all of it on the CPU (``octavo_tpu.runtime``).
"""

from __future__ import annotations

import psutil
import torch

from octavo.ops import reference
from octavo.platform import Capabilities, MemoryInfo, PlatformInfo, hookimpl
from octavo_tpu import runtime

NAME = "tpu"
PRIORITY = 30
INTERPRET_KV_CACHE_MEMORY = 64 << 20  # bytes, when interpreting and no size is given


def _mine(platform: PlatformInfo) -> bool:
    return platform.name == NAME


@hookimpl
def octavo_platform_detect() -> PlatformInfo:
    interpret = runtime.interpreting()
    why = runtime.why_unavailable(interpret)
    if why is not None:
        return PlatformInfo(NAME, "tpu", False, PRIORITY, why)
    return PlatformInfo(NAME, "tpu", True, PRIORITY, runtime.reason(interpret))


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


@hookimpl
def octavo_configure(platform, config):
    if not _mine(platform):
        return None
    if runtime.interpreting() and getattr(config, "kv_cache_memory", None) is None:
        total = psutil.virtual_memory().total
        return {"kv_cache_memory": min(INTERPRET_KV_CACHE_MEMORY, total // 5)}
    return None


@hookimpl
def octavo_device_init(platform, local_rank):
    if _mine(platform):
        return torch.device("cpu")  # the torch side (host arrays); JAX places the model


@hookimpl
def octavo_memory_info(platform, device):
    if not _mine(platform):
        return None
    if runtime.interpreting():
        vm = psutil.virtual_memory()
        return MemoryInfo(total=vm.total, free=vm.available, used=vm.total - vm.available)
    stats = runtime.jax_device(False).memory_stats() or {}
    total, used = stats.get("bytes_limit", 0), stats.get("bytes_in_use", 0)
    return MemoryInfo(total=total, free=total - used, used=used)


@hookimpl
def octavo_model_runner(platform, config):
    if _mine(platform):
        from octavo_tpu.runner import make_runner

        return make_runner(runtime.interpreting())


@hookimpl
def octavo_attention_backend(platform, spec):
    if _mine(platform):
        from octavo_tpu.bridge import PallasAttentionBackend

        return PallasAttentionBackend(spec, runtime.interpreting())


@hookimpl
def octavo_rms_norm(platform, hidden_size, eps, dtype):
    if _mine(platform):
        from octavo_tpu.bridge import make_rms_norm

        return make_rms_norm(eps, runtime.interpreting())


@hookimpl
def octavo_sampler(platform, vocab_size):
    if _mine(platform):
        from octavo_tpu.bridge import make_sampler

        return make_sampler(runtime.interpreting())


@hookimpl
def octavo_apply_token_bitmask(platform):
    if _mine(platform):
        return reference.apply_token_bitmask  # grammars run on the host's copy of the logits
