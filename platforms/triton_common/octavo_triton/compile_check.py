"""Compile every kernel for real GPU targets on a machine without a GPU.

``triton.compile(ASTSource(...), target=GPUTarget(...))`` runs the whole Triton pipeline (TTIR,
TTGIR, LLVM IR, then PTX and a cubin through the bundled ptxas for NVIDIA, or AMDGCN and an
hsaco through the built-in LLVM linker for AMD). It catches what the interpreter cannot see:
dot shapes and operand types the chip's matrix units reject, loop-carried type changes,
shared-memory overruns for the chosen tiles. Kernels must be real ``JITFunction`` objects, so
this runs without ``TRITON_INTERPRET`` (the test runs it in a subprocess).
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Callable, Sequence

import torch
import triton
from triton.backends.compiler import GPUTarget

from octavo.platform.types import AttentionSpec
from octavo_triton import (
    attention_kernels,
    bitmask,
    fp8,
    rejection_sampler,
    rms_norm,
    sampler_kernels,
)
from octavo_triton.attention import TritonAttentionBackend
from octavo_triton.runtime import interpreting, next_power_of_2
from octavo_triton.tuning import (
    AttentionTuning,
    GpuTuning,
    MatmulTuning,
    RowTuning,
    SamplerTuning,
)

TRITON_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
FLOAT_ARGS = ("scale", "eps", "fp8_max", "min_scale")

# Llama-3-8B (GQA 4, head 128), a wide-head model (head 256, MQA) and a sliding-window one.
MODEL_SPECS = (
    ("llama-h128", AttentionSpec(32, 8, 128, torch.float16, 16, 128**-0.5)),
    ("wide-h256", AttentionSpec(8, 1, 256, torch.bfloat16, 16, 256**-0.5)),
    ("window-h64", AttentionSpec(16, 4, 64, torch.float16, 32, 64**-0.5, sliding_window=4096)),
)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclasses.dataclass(frozen=True)
class KernelBuild:
    """One specialisation of one kernel: pointer element types, constexprs, launch options."""

    name: str
    kernel: Any
    pointers: dict[str, str]
    constexprs: dict[str, Any]
    options: dict[str, int]

    def source(self) -> triton.compiler.ASTSource:
        """The ASTSource: pointers as given, ``FLOAT_ARGS`` fp32, other scalars i32."""
        signature = {}
        for arg in self.kernel.arg_names:
            if arg in self.constexprs:
                signature[arg] = "constexpr"
            elif arg in self.pointers:
                signature[arg] = "*" + self.pointers[arg]
            else:
                signature[arg] = "fp32" if arg in FLOAT_ARGS else "i32"
        return triton.compiler.ASTSource(self.kernel, signature, constexprs=self.constexprs)


def attention_builds(spec: AttentionSpec, tuning: AttentionTuning, label: str) -> list[KernelBuild]:
    """The KV write and the unified attention for ``spec`` with ``tuning``'s tiles."""
    backend = TritonAttentionBackend(spec, tuning)
    t = TRITON_TYPES[spec.dtype]
    write = KernelBuild(
        f"write_kv[{label}]",
        attention_kernels.write_kv_kernel,
        {
            "key_ptr": t,
            "value_ptr": t,
            "k_cache_ptr": t,
            "v_cache_ptr": t,
            "slot_mapping_ptr": "i64",
        },
        dict(
            NUM_KV_HEADS=spec.num_kv_heads,
            HEAD_DIM=spec.head_dim,
            BLOCK_SIZE=spec.block_size,
            HEADS_PAD=next_power_of_2(spec.num_kv_heads),
            HEAD_DIM_PAD=next_power_of_2(spec.head_dim),
            BLOCK_T=tuning.kv_write_tokens,
            EMULATE_BF16=False,
        ),
        {},
    )
    pointers = {
        "out_ptr": t,
        "q_ptr": t,
        "k_cache_ptr": t,
        "v_cache_ptr": t,
        "block_table_ptr": "i32",
        "seq_lens_ptr": "i32",
        "query_start_loc_ptr": "i32",
        "partial_ptr": "fp32",
        "max_ptr": "fp32",
        "sum_ptr": "fp32",
    }
    constexprs = backend.kernel_constexprs(spec.dtype, spec.dtype, spec.block_size)
    options = {"num_warps": tuning.num_warps, "num_stages": tuning.num_stages}
    builds = [
        write,
        KernelBuild(
            f"unified_attention[{label}]",
            attention_kernels.unified_attention_kernel,
            pointers,
            {**constexprs, "NUM_SEGMENTS": 1},
            options,
        ),
    ]
    if tuning.split_kv_segment_len > 0:
        segments = tuning.split_kv_max_segments
        builds.append(
            KernelBuild(
                f"split_kv_attention[{label}]",
                attention_kernels.unified_attention_kernel,
                pointers,
                {**constexprs, "NUM_SEGMENTS": segments},
                options,
            )
        )
        builds.append(
            KernelBuild(
                f"merge_segments[{label}]",
                attention_kernels.merge_segments_kernel,
                {
                    "out_ptr": t,
                    "partial_ptr": "fp32",
                    "max_ptr": "fp32",
                    "sum_ptr": "fp32",
                    "query_start_loc_ptr": "i32",
                },
                dict(
                    NUM_SEGMENTS=segments,
                    SEGMENTS_PAD=next_power_of_2(segments),
                    HEAD_DIM=spec.head_dim,
                    HEAD_DIM_PAD=backend.head_dim_pad,
                    EMULATE=False,
                ),
                {"num_warps": 4},
            )
        )
    return builds


def model_attention_builds(tuning: GpuTuning) -> list[KernelBuild]:
    """The attention kernels for ``MODEL_SPECS`` with a platform's tiles: the first model in
    every dtype, the others in their own."""
    builds = []
    for index, (name, spec) in enumerate(MODEL_SPECS):
        for dtype in DTYPES if index == 0 else (spec.dtype,):
            typed = dataclasses.replace(spec, dtype=dtype)
            tiles = tuning.attention_for(typed.head_dim)
            builds += attention_builds(typed, tiles, f"{name},{TRITON_TYPES[dtype]}")
    return builds


def rms_norm_builds(hidden_size: int, dtype: torch.dtype, tuning: RowTuning) -> list[KernelBuild]:
    """RMSNorm with and without the fused residual add."""
    t = TRITON_TYPES[dtype]
    block = next_power_of_2(hidden_size)
    pointers = {
        name: t for name in ("out_ptr", "residual_out_ptr", "x_ptr", "residual_ptr", "weight_ptr")
    }
    return [
        KernelBuild(
            f"rms_norm[{t},h{hidden_size},{'fused' if fused else 'plain'}]",
            rms_norm.rms_norm_kernel,
            pointers,
            dict(HAS_RESIDUAL=fused, UPCAST=False, BLOCK_N=block),
            {"num_warps": rms_norm.warps_for(block, tuning.warp_size)},
        )
        for fused in (False, True)
    ]


def sampler_builds(tuning: SamplerTuning) -> list[KernelBuild]:
    """The sampler with every filter on, and its all-greedy specialisation."""
    pointers = {
        "out_ptr": "i64",
        "logits_ptr": "fp32",
        "noise_ptr": "fp32",
        "temperature_ptr": "fp32",
        "top_k_ptr": "i32",
        "top_p_ptr": "fp32",
        "min_p_ptr": "fp32",
    }
    return [
        KernelBuild(
            f"sample[{'greedy' if greedy else 'all filters'}]",
            sampler_kernels.sample_kernel,
            pointers,
            dict(
                ALL_GREEDY=greedy,
                USE_TOP_K=not greedy,
                USE_TOP_P=not greedy,
                USE_MIN_P=not greedy,
                BLOCK_R=tuning.block_r,
                BLOCK_V=tuning.block_v,
            ),
            {"num_warps": tuning.num_warps},
        )
        for greedy in (False, True)
    ]


def bitmask_builds(tuning: RowTuning) -> list[KernelBuild]:
    """The bitmask apply, by row and through indices."""
    return [
        KernelBuild(
            f"apply_bitmask[{'indices' if indexed else 'rows'}]",
            bitmask.apply_bitmask_kernel,
            {"logits_ptr": "fp32", "bitmask_ptr": "i32", "indices_ptr": "i64"},
            dict(HAS_INDICES=indexed, BLOCK=tuning.bitmask_block),
            {"num_warps": max(1, tuning.bitmask_block // (tuning.warp_size * 8))},
        )
        for indexed in (False, True)
    ]


def rejection_sampler_builds(tuning: SamplerTuning) -> list[KernelBuild]:
    """The speculative-decoding verifier, with draft probabilities and with point-mass drafts."""
    pointers = {
        "out_ptr": "i64",
        "draft_ptr": "i64",
        "draft_probs_ptr": "fp32",
        "target_probs_ptr": "fp32",
        "target_argmax_ptr": "i64",
        "cu_ptr": "i32",
        "temperature_ptr": "fp32",
        "uniforms_ptr": "fp32",
        "noise_ptr": "fp32",
    }
    return [
        KernelBuild(
            f"rejection_sample[{'draft probs' if has_probs else 'point-mass drafts'}]",
            rejection_sampler.rejection_sample_kernel,
            pointers,
            dict(HAS_DRAFT_PROBS=has_probs, BLOCK_R=tuning.block_r, BLOCK_V=tuning.block_v),
            {"num_warps": tuning.num_warps},
        )
        for has_probs in (True, False)
    ]


def fp8_builds(tuning: MatmulTuning, fp8_type: str, widen: bool) -> list[KernelBuild]:
    """The scaled matmul (per-token x per-channel scales with bias into bf16, per-tensor into
    fp16) and the per-token activation quantisation, for ``fp8_type`` (``fp8e4nv`` is OCP
    e4m3, ``fp8e4b8`` the e4m3fnuz of gfx942). Widened, the operands are bytes and the
    quantisation is left out: such chips have no FP8 type to store."""
    builds = []
    operand = "u8" if widen else fp8_type
    for out, per_row, bias in (("bf16", True, True), ("fp16", False, False)):
        builds.append(
            KernelBuild(
                f"scaled_mm[{fp8_type}->{out}{',widened' if widen else ''}]",
                fp8.scaled_mm_kernel,
                {
                    "out_ptr": out,
                    "a_ptr": operand,
                    "b_ptr": operand,
                    "scale_a_ptr": "fp32",
                    "scale_b_ptr": "fp32",
                    "bias_ptr": out,
                },
                dict(
                    PER_TOKEN_A=per_row,
                    PER_CHANNEL_B=per_row,
                    HAS_BIAS=bias,
                    WIDEN=widen,
                    BLOCK_M=tuning.block_m,
                    BLOCK_N=tuning.block_n,
                    BLOCK_K=tuning.block_k,
                    GROUP_M=tuning.group_m,
                    EMULATE=False,
                ),
                {"num_warps": tuning.num_warps, "num_stages": tuning.num_stages},
            )
        )
    if not widen:
        builds.append(
            KernelBuild(
                f"per_token_quant[bf16->{fp8_type}]",
                fp8.per_token_quant_kernel,
                {"q_ptr": fp8_type, "scale_ptr": "fp32", "x_ptr": "bf16"},
                dict(BLOCK_K=2048, EMULATE=False),
                {"num_warps": 8},
            )
        )
    return builds


def compile_builds(builds: Sequence[KernelBuild], target: GPUTarget) -> list[dict]:
    """Compile each build for ``target``; returns one record per build (stages, shared memory).
    A compilation error propagates with the build's name."""
    if interpreting():
        raise RuntimeError("compilation checks need real JITFunctions: unset TRITON_INTERPRET")
    records = []
    for build in builds:
        try:
            compiled = triton.compile(build.source(), target=target, options=build.options)
        except Exception as exc:
            raise RuntimeError(f"{build.name} failed to compile for {target}: {exc}") from exc
        records.append(
            {
                "kernel": build.name,
                "target": f"{target.backend}:{target.arch}",
                "stages": [s for s in ("ptx", "cubin", "amdgcn", "hsaco") if s in compiled.asm],
                "shared_bytes": compiled.metadata.shared,
            }
        )
    return records


def main(
    argv: Sequence[str] | None,
    description: str,
    default_archs: Sequence[Any],
    target: Callable[[Any], GPUTarget],
    builds: Callable[[Any], list[KernelBuild]],
    arch_type: Callable[[str], Any] = str,
) -> int:
    """A platform's ``python -m ..compile_check [--arch A ...]``: compile ``builds(arch)`` for
    ``target(arch)`` for each ``--arch`` (default ``default_archs``), one line per kernel."""
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--arch",
        type=arch_type,
        action="append",
        help=f"GPU architecture (repeatable; default: {' '.join(map(str, default_archs))})",
    )
    args = parser.parse_args(argv)
    for arch in args.arch or default_archs:
        for record in compile_builds(builds(arch), target(arch)):
            stages = "+".join(record["stages"])
            print(
                f"{record['target']:11} {record['kernel']:45} {stages:13} "
                f"shared {record['shared_bytes']} B"
            )
    return 0
