"""Hook implementations of the cpu platform: detection, capabilities, memory, and the kernels of
``attention``, ``rms_norm``, ``rotary_embedding``, ``silu_and_mul``, ``sampler``,
``token_bitmask`` and ``rejection_sampler``, the batched multi-LoRA products (``lora_kernels``),
a Mixture-of-Experts layer's experts in one compiled call (``fused_moe``), latent attention
(``mla_attention_backend``), and FP8
``scaled_mm`` (the reference's), Llama decoder layers in one compiled call (``decoder_stack``),
an EAGLE-family head's forward in two (``draft_head``), the forward that runs each step on the
threads its size pays for (``graph_runner``), and the collectives of tensor parallelism
(``communicator``: all-reduce through shared memory for ranks on one host, else gloo). This
module only wires them."""

from __future__ import annotations

import functools
import logging

import psutil
import torch

from octavo.ops import reference
from octavo.platform import Capabilities, MemoryInfo, PlatformInfo, hookimpl
from octavo_cpu.activation import make_silu_and_mul
from octavo_cpu.attention import CpuAttentionBackend
from octavo_cpu.compiled_graph import CompiledForward, compile_cache_dir
from octavo_cpu.decoder_stack import make_decoder_stack
from octavo_cpu.draft_head import describe_draft_weights, make_draft_head
from octavo_cpu.fused_moe import make_fused_moe
from octavo_cpu.gemm import describe_gemm, linear_packer
from octavo_cpu.kernels import load_kernels
from octavo_cpu.lora import make_lora_kernels
from octavo_cpu.mla import make_mla_backend
from octavo_cpu.quantized_gemm import quantized_packer
from octavo_cpu.rejection_sampler import make_greedy_verify, rejection_sample
from octavo_cpu.rms_norm import make_rms_norm
from octavo_cpu.rotary import make_rotary_embedding
from octavo_cpu.sampler import make_argmax, make_sampler
from octavo_cpu.shm_communicator import make_communicator
from octavo_cpu.threads import StepThreads, ThreadedForward
from octavo_cpu.token_bitmask import TokenBitmaskKernel

NAME = "cpu"
logger = logging.getLogger(__name__)


def _mine(platform: PlatformInfo) -> bool:
    return platform.name == NAME


@hookimpl
def octavo_platform_detect() -> PlatformInfo:
    return PlatformInfo(
        name=NAME,
        device_type="cpu",
        available=True,
        priority=0,
        reason=(
            f"always available: torch {torch.__version__} on {psutil.cpu_count()} CPU cores; "
            f"kernels: {describe_kernels()}; GEMM: {describe_gemm()}; "
            f"threads: {describe_threads()}; draft heads: {describe_draft_weights()}"
        ),
    )


def describe_kernels() -> str:
    """Which kernel path the platform runs, and why (a bad OCTAVO_CPU_KERNELS is reported here
    and refused when an engine starts)."""
    try:
        chosen = load_kernels()
    except ValueError as exc:
        return f"not usable: {exc}"
    return f"{chosen.path}, {chosen.reason}"


def describe_threads() -> str:
    try:
        return StepThreads.from_env().describe()
    except ValueError as exc:
        return f"not usable: {exc}"


@hookimpl
def octavo_platform_capabilities(platform):
    if _mine(platform):
        return Capabilities(
            dtypes=(torch.float32, torch.bfloat16),
            block_sizes=(1, 8, 16, 32, 64, 128),
            supports_fp8=True,  # scaled_mm: the reference, FP8 emulated in float32
            supports_graphs=False,
            dist_backend="gloo",
            pin_host_memory=False,  # the device is the host: nothing to stage
            widened_matmul_dtypes=slow_matmul_dtypes(),
        )


def slow_matmul_dtypes() -> tuple[torch.dtype, ...]:
    """Low-precision dtypes this CPU has no native matmul for (oneDNN says so): torch emulates
    them several times slower than float32 (bfloat16 without AVX512-BF16/AMX, float16 without
    AVX512-FP16/AMX-FP16), so their linear layers are better computed in float32."""
    native = {
        torch.bfloat16: torch.ops.mkldnn._is_mkldnn_bf16_supported(),
        torch.float16: torch.ops.mkldnn._is_mkldnn_fp16_supported(),
    }
    return tuple(dtype for dtype, supported in native.items() if not supported)


DEFAULT_KV_CACHE_MEMORY = 4 << 30
"""The host is shared with everything else: like vLLM's CPU backend, the KV cache defaults to a
fixed size (at most a fifth of RAM) instead of ``--gpu-memory-utilization`` of all memory."""


@hookimpl
def octavo_configure(platform, config):
    if _mine(platform) and getattr(config, "kv_cache_memory", None) is None:
        return {"kv_cache_memory": min(DEFAULT_KV_CACHE_MEMORY, psutil.virtual_memory().total // 5)}


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
def octavo_rotary_embedding(platform):
    if _mine(platform):
        return make_rotary_embedding()


@hookimpl
def octavo_silu_and_mul(platform):
    if _mine(platform):
        return make_silu_and_mul()


@hookimpl
def octavo_linear_packer(platform, dtype):
    if _mine(platform):
        return linear_packer(dtype, widened=slow_matmul_dtypes())


@hookimpl
def octavo_quantized_linear_packer(platform, quant_type):
    if _mine(platform):
        return quantized_packer(quant_type)


@hookimpl
def octavo_rms_norm(platform, hidden_size, eps, dtype):
    if _mine(platform):
        return make_rms_norm(hidden_size, eps, dtype, load_kernels().ops)


@hookimpl
def octavo_lora_kernels(platform, dtype):
    if _mine(platform):
        return make_lora_kernels(dtype, load_kernels().ops)  # None: the reference serves


@hookimpl
def octavo_fused_moe(platform, spec):
    if _mine(platform):
        return make_fused_moe(spec, load_kernels().ops)  # None: the reference serves


@hookimpl
def octavo_mla_attention_backend(platform, spec):
    if _mine(platform):
        return make_mla_backend(spec, load_kernels().ops)  # None: the reference serves


@hookimpl
def octavo_sampler(platform, vocab_size):
    if _mine(platform):
        return make_sampler(load_kernels().ops)


@hookimpl
def octavo_apply_token_bitmask(platform):
    if _mine(platform):
        return TokenBitmaskKernel()


@hookimpl
def octavo_scaled_mm(platform):
    if _mine(platform):
        return reference.scaled_mm  # FP8 values exactly widened to float32; one float32 matmul


@hookimpl
def octavo_rejection_sampler(platform):
    if _mine(platform):
        ops = load_kernels().ops
        return functools.partial(
            rejection_sample, argmax=make_argmax(ops), greedy=make_greedy_verify(ops)
        )


@hookimpl
def octavo_communicator(platform, group):
    if _mine(platform):
        return make_communicator(group)  # shared memory on one host, else gloo


@hookimpl
def octavo_graph_runner(platform, model, config):
    if _mine(platform):
        forward = model if config.enforce_eager else compiled_forward(model, config)
        return ThreadedForward(forward, StepThreads.from_env())


@hookimpl
def octavo_decoder_stack(platform, layers, norm):
    if _mine(platform):
        return make_decoder_stack(layers, norm, load_kernels().ops)


@hookimpl
def octavo_draft_head(platform, head):
    if _mine(platform):
        return make_draft_head(head, load_kernels().ops)


def compiled_forward(model, config):
    """The model's forward compiled by inductor (``--no-enforce-eager``), or the model itself
    where the compiled kernels do not run (the torch path's attention breaks a graph at every
    layer: the runner then says the model runs eagerly)."""
    kernels = load_kernels()
    if kernels.ops is None:
        logger.info("--no-enforce-eager needs the compiled kernels: %s", kernels.reason)
        return model
    return CompiledForward(model, compile_cache_dir(config.compile_cache_dir))
