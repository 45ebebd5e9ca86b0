"""Compile the rocm platform's kernels, with its own tuning, for CDNA3 (gfx942) without a GPU.

    python -m octavo_rocm.compile_check [--arch gfx942 --arch gfx90a]

Builds AMDGCN and an hsaco with Triton's built-in LLVM linker. Runs without
``TRITON_INTERPRET``; exits non-zero naming the first kernel that fails.
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton.language as tl
from triton.backends.compiler import GPUTarget

from octavo.platform.types import AttentionSpec
from octavo_rocm import rms_norm, sampler, tuning
from octavo_triton import compile_check as cc
from octavo_triton.runtime import next_power_of_2

# Llama-3-8B (GQA 4, head 128), a wide-head model (head 256, MQA) and a sliding-window one.
SPECS = (
    ("llama-h128", AttentionSpec(32, 8, 128, torch.float16, 16, 128**-0.5)),
    ("wide-h256", AttentionSpec(8, 1, 256, torch.bfloat16, 16, 256**-0.5)),
    ("window-h64", AttentionSpec(16, 4, 64, torch.float16, 32, 64**-0.5, sliding_window=4096)),
)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def rms_norm_builds(hidden_size: int, dtype: torch.dtype) -> list[cc.KernelBuild]:
    """The persistent fused add + RMSNorm, plain and fused, in one block or column blocks."""
    t = cc.TRITON_TYPES[dtype]
    block = min(next_power_of_2(hidden_size), tuning.ROWS.max_block)
    pointers = {
        name: t for name in ("out_ptr", "residual_out_ptr", "x_ptr", "residual_ptr", "weight_ptr")
    }
    warps = max(1, min(16, block // (tuning.WARP_SIZE * 4)))
    return [
        cc.KernelBuild(
            f"rms_norm[{t},h{hidden_size},{'fused' if fused else 'plain'}]",
            rms_norm.fused_add_rms_norm_kernel,
            pointers,
            dict(HAS_RESIDUAL=fused, UPCAST=False, BLOCK_N=block, ONE_BLOCK=block >= hidden_size),
            {"num_warps": warps},
        )
        for fused in (False, True)
    ]


def rms_norm_fp8_builds(hidden_size: int) -> list[cc.KernelBuild]:
    """The fused add + RMSNorm + per-token quantisation to gfx942's e4m3fnuz, from bf16."""
    block = next_power_of_2(hidden_size)
    return [
        cc.KernelBuild(
            f"rms_norm_fp8[bf16->fp8e4b8,h{hidden_size}]",
            rms_norm.fused_add_rms_norm_fp8_kernel,
            {
                "q_ptr": "fp8e4b8",
                "scale_ptr": "fp32",
                "residual_out_ptr": "bf16",
                "x_ptr": "bf16",
                "residual_ptr": "bf16",
                "weight_ptr": "bf16",
            },
            dict(
                HAS_RESIDUAL=True,
                UPCAST=False,
                EMULATE_FP8=False,
                OUT_DTYPE=tl.bfloat16,
                BLOCK_N=block,
            ),
            {"num_warps": max(1, min(16, block // (tuning.WARP_SIZE * 4)))},
        )
    ]


def sampler_builds() -> list[cc.KernelBuild]:
    """The split-vocabulary kernels, and the shared filtering kernel with wave64 chunks."""
    split = cc.KernelBuild(
        "split_candidates",
        sampler.split_candidates_kernel,
        {
            "greedy_val_ptr": "fp32",
            "greedy_idx_ptr": "i32",
            "race_val_ptr": "fp32",
            "race_idx_ptr": "i32",
            "logits_ptr": "fp32",
            "noise_ptr": "fp32",
            "temperature_ptr": "fp32",
        },
        dict(ALL_GREEDY=False, BLOCK_V=tuning.SAMPLER.block_v),
        {"num_warps": tuning.SAMPLER.num_warps},
    )
    pick = cc.KernelBuild(
        "pick_winner",
        sampler.pick_winner_kernel,
        {
            "out_ptr": "i64",
            "greedy_val_ptr": "fp32",
            "greedy_idx_ptr": "i32",
            "race_val_ptr": "fp32",
            "race_idx_ptr": "i32",
            "temperature_ptr": "fp32",
        },
        dict(SPLITS_PAD=64),
        {"num_warps": 1},
    )
    return [split, pick] + cc.sampler_builds(tuning.SAMPLER)


def builds() -> list[cc.KernelBuild]:
    """Every kernel the rocm platform launches, in the specialisations models use."""
    out = []
    for name, spec in SPECS:
        for dtype in DTYPES if name == "llama-h128" else (spec.dtype,):
            s = AttentionSpec(
                spec.num_heads,
                spec.num_kv_heads,
                spec.head_dim,
                dtype,
                spec.block_size,
                spec.scale,
                spec.sliding_window,
            )
            out += cc.attention_builds(
                s, tuning.attention_tuning(s), f"{name},{cc.TRITON_TYPES[dtype]}"
            )
    for dtype in DTYPES:
        out += rms_norm_builds(4096, dtype)
    out += rms_norm_builds(16384, torch.bfloat16)  # wider than a block: the two-pass path
    out += rms_norm_fp8_builds(4096)
    out += sampler_builds()
    out += cc.rejection_sampler_builds(tuning.SAMPLER)
    out += cc.bitmask_builds(tuning.ROWS)
    out += cc.fp8_builds(tuning.MATMUL, "fp8e4b8", widen=False)  # gfx942's FP8 is e4m3fnuz
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--arch", action="append", help="AMD GPU architecture, e.g. gfx942 (repeatable)"
    )
    args = parser.parse_args(argv)
    for arch in args.arch or ["gfx942"]:
        for record in cc.compile_builds(builds(), GPUTarget("hip", arch, tuning.WARP_SIZE)):
            print(
                f"{record['target']:11} {record['kernel']:45} {'+'.join(record['stages']):13} "
                f"shared {record['shared_bytes']} B"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
