"""The hooks the Triton GPU platforms (cuda, rocm) have in common, as one plugin object.

A platform says what is its own in a :class:`GpuPlatform` (its name, how it tells whether its
GPU is usable, its tiles, the kernels it replaces) and registers a :class:`TritonGpuPlugin`
built from it as its ``octavo.platforms`` entry point. The plugin then answers detection,
capabilities, device set-up, memory and every kernel hook, for that platform's name only.

Both platforms compute on what torch calls ``"cuda"`` devices (ROCm builds of torch name HIP
devices so), with the ``"nccl"`` process-group backend (RCCL on ROCm). Under the Triton
interpreter (``runtime.emulated``) a platform reports ``device_type="cpu"`` and runs every kernel
on CPU tensors: no graphs, ``gloo``, host memory, nothing pinned.

The kernel modules (Triton, and the parsing of every ``@triton.jit`` source) are imported by the
kernel hooks, when the platform is the one chosen: a host where it is installed but not usable
(the cpu platform's machines) does not pay for them at every start-up.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Callable, Optional

import psutil
import torch

from octavo.distributed.communicator import TorchDistributedCommunicator
from octavo.platform import Capabilities, MemoryInfo, PlatformInfo, RMSNormFn, SamplerFn, hookimpl
from octavo_triton import runtime
from octavo_triton.tuning import GpuTuning

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BLOCK_SIZES = (1, 8, 16, 32, 64, 128)
PRIORITY = 20
"""Above the host (0) and an emulated NPU (10), below a TPU (30): a machine has one kind of GPU."""


def shared_rms_norm(hidden_size: int, eps: float, tuning: GpuTuning) -> RMSNormFn:
    """The shared fused residual add + RMSNorm with the platform's row tiles."""
    from octavo_triton.rms_norm import make_rms_norm

    return make_rms_norm(hidden_size, eps, tuning.rows)


def shared_sampler(vocab_size: int, tuning: GpuTuning) -> SamplerFn:
    """The shared sort-free sampler with the platform's chunks."""
    from octavo_triton.sampler import make_sampler

    return make_sampler(vocab_size, tuning.sampler)


def never() -> bool:
    """The default ``widen_fp8``: the chips multiply FP8 natively."""
    return False


@dataclasses.dataclass(frozen=True)
class GpuPlatform:
    """What one Triton GPU platform has of its own.

    ``name`` is also its ``device_type`` when not emulated; ``devices`` is what its GPUs are
    called in messages ("CUDA"). ``wrong_build()`` says why the installed torch cannot drive
    them (None when it can) and ``runtime()`` names the runtime torch was built with ("CUDA
    12.4"): both read ``torch.version`` only. ``visibility_hint`` says where to look when torch
    sees no device. ``rms_norm(hidden_size, eps, tuning)`` and ``sampler(vocab_size, tuning)``
    build the platform's own kernels (default: the shared ones); ``widen_fp8()`` says, on a real
    GPU, whether FP8 operands must be widened to float16 (chips without FP8 matrix units).
    """

    name: str
    devices: str
    wrong_build: Callable[[], Optional[str]]
    runtime: Callable[[], str]
    visibility_hint: str
    tuning: GpuTuning
    priority: int = PRIORITY
    rms_norm: Callable[[int, float, GpuTuning], RMSNormFn] = shared_rms_norm
    sampler: Callable[[int, GpuTuning], SamplerFn] = shared_sampler
    widen_fp8: Callable[[], bool] = never


class TritonGpuPlugin:
    """The hook implementations of one :class:`GpuPlatform` (register this object)."""

    def __init__(self, gpu: GpuPlatform):
        self.gpu = gpu

    def __repr__(self) -> str:
        return f"TritonGpuPlugin({self.gpu.name!r})"

    def mine(self, platform: PlatformInfo) -> bool:
        return platform.name == self.gpu.name

    def emulated(self, platform: PlatformInfo) -> bool:
        """True when this platform runs in the Triton interpreter on the CPU."""
        return self.mine(platform) and platform.device_type == "cpu"

    # --- detection and set-up ------------------------------------------------------------------

    def why_unavailable(self) -> Optional[str]:
        """None when the GPU can be used, else the reason. Never creates a device context."""
        gpu = self.gpu
        why = gpu.wrong_build()
        if why is not None:
            return why
        if importlib.util.find_spec("triton") is None:
            return f"triton is not installed (pip install octavo[{gpu.name}])"
        if not torch.cuda.is_available():
            return f"no {gpu.devices} device is visible ({gpu.visibility_hint})"
        return None

    @hookimpl
    def octavo_platform_detect(self) -> PlatformInfo:
        gpu = self.gpu
        if runtime.emulated(gpu.name):
            reason = runtime.emulation_reason(gpu.name)
            return PlatformInfo(gpu.name, "cpu", True, gpu.priority, reason)
        why = self.why_unavailable()
        if why is not None:
            return PlatformInfo(gpu.name, gpu.name, False, gpu.priority, why)
        reason = f"{torch.cuda.device_count()} {gpu.devices} device(s), {gpu.runtime()}"
        return PlatformInfo(gpu.name, gpu.name, True, gpu.priority, reason)

    @hookimpl
    def octavo_platform_capabilities(self, platform):
        if self.mine(platform):
            on_gpu = not self.emulated(platform)
            return Capabilities(
                dtypes=DTYPES,
                block_sizes=BLOCK_SIZES,
                supports_fp8=True,
                supports_graphs=on_gpu,
                dist_backend="nccl" if on_gpu else "gloo",
                pin_host_memory=on_gpu,
            )

    @hookimpl
    def octavo_device_init(self, platform, local_rank):
        if self.mine(platform):
            if self.emulated(platform):
                return torch.device("cpu")
            torch.cuda.set_device(local_rank)
            return torch.device("cuda", local_rank)

    @hookimpl
    def octavo_memory_info(self, platform, device):
        if self.mine(platform):
            if self.emulated(platform):
                vm = psutil.virtual_memory()
                return MemoryInfo(total=vm.total, free=vm.available, used=vm.total - vm.available)
            free, total = torch.cuda.mem_get_info(device)
            return MemoryInfo(total=total, free=free, used=total - free)

    @hookimpl
    def octavo_communicator(self, platform, group):
        if self.mine(platform):
            return TorchDistributedCommunicator(group)  # nccl (rccl on ROCm): dist_backend

    # --- kernels -----------------------------------------------------------------------------

    @hookimpl
    def octavo_attention_backend(self, platform, spec):
        if self.mine(platform):
            from octavo_triton.attention import TritonAttentionBackend

            backend = TritonAttentionBackend(spec, self.gpu.tuning.attention_for(spec.head_dim))
            backend.name = f"{self.gpu.name}-triton"
            return backend

    @hookimpl
    def octavo_rms_norm(self, platform, hidden_size, eps):
        if self.mine(platform):
            return self.gpu.rms_norm(hidden_size, eps, self.gpu.tuning)

    @hookimpl
    def octavo_sampler(self, platform, vocab_size):
        if self.mine(platform):
            return self.gpu.sampler(vocab_size, self.gpu.tuning)

    @hookimpl
    def octavo_apply_token_bitmask(self, platform):
        if self.mine(platform):
            from octavo_triton.bitmask import make_apply_token_bitmask

            return make_apply_token_bitmask(self.gpu.tuning.rows)

    @hookimpl
    def octavo_scaled_mm(self, platform):
        if self.mine(platform):
            from octavo_triton.fp8 import make_scaled_mm

            widen = not self.emulated(platform) and self.gpu.widen_fp8()
            return make_scaled_mm(self.gpu.tuning.matmul, widen=widen)

    @hookimpl
    def octavo_lora_kernels(self, platform, dtype):
        if self.mine(platform) and dtype in DTYPES:
            from octavo_triton.lora import make_lora_kernels

            return make_lora_kernels(dtype)

    @hookimpl
    def octavo_rejection_sampler(self, platform):
        if self.mine(platform):
            from octavo_triton.rejection_sampler import make_rejection_sampler

            return make_rejection_sampler(self.gpu.tuning.sampler)

    @hookimpl
    def octavo_fused_moe(self, platform, spec):
        if self.mine(platform) and spec.dtype in DTYPES and spec.activation == "silu":
            from octavo_triton.fused_moe import make_fused_moe

            return make_fused_moe(spec)

    @hookimpl
    def octavo_mla_attention_backend(self, platform, spec):
        if self.mine(platform) and spec.dtype in DTYPES:
            from octavo_triton.mla import make_mla_backend

            backend = make_mla_backend(spec)
            backend.name = f"{self.gpu.name}-triton-mla"
            return backend
