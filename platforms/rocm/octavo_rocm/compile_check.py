"""Compile the rocm platform's kernels, with its own tuning, for CDNA3 (gfx942) without a GPU.

    python -m octavo_rocm.compile_check [--arch gfx942 --arch gfx90a]

Builds AMDGCN and an hsaco with Triton's built-in LLVM linker. Runs without
``TRITON_INTERPRET``; exits non-zero naming the first kernel that fails.
"""

from __future__ import annotations

import sys

import torch
import triton.language as tl
from triton.backends.compiler import GPUTarget

from octavo_rocm import rms_norm, sampler
from octavo_rocm.tuning import TUNING, WARP_SIZE
from octavo_triton import compile_check as cc
from octavo_triton.runtime import next_power_of_2


def rms_norm_builds(hidden_size: int, dtype: torch.dtype) -> list[cc.KernelBuild]:
    """The persistent fused add + RMSNorm, plain and fused, in one block or column blocks."""
    t = cc.TRITON_TYPES[dtype]
    block = min(next_power_of_2(hidden_size), TUNING.rows.max_block)
    pointers = {
        name: t for name in ("out_ptr", "residual_out_ptr", "x_ptr", "residual_ptr", "weight_ptr")
    }
    warps = max(1, min(16, block // (WARP_SIZE * 4)))
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
            {"num_warps": max(1, min(16, block // (WARP_SIZE * 4)))},
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
        dict(ALL_GREEDY=False, BLOCK_V=TUNING.sampler.block_v),
        {"num_warps": TUNING.sampler.num_warps},
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
    return [split, pick] + cc.sampler_builds(TUNING.sampler)


def builds(arch: str = "gfx942") -> list[cc.KernelBuild]:
    """Every kernel the rocm platform launches, in the specialisations models use (the same
    for every CDNA ``arch``)."""
    out = cc.model_attention_builds(TUNING)
    for dtype in cc.DTYPES:
        out += rms_norm_builds(4096, dtype)
    out += rms_norm_builds(16384, torch.bfloat16)  # wider than a block: the two-pass path
    out += rms_norm_fp8_builds(4096)
    out += sampler_builds()
    out += cc.rejection_sampler_builds(TUNING.sampler)
    out += cc.bitmask_builds(TUNING.rows)
    out += cc.fp8_builds(TUNING.matmul, "fp8e4b8", widen=False)  # gfx942's FP8 is e4m3fnuz
    return out


def target(arch: str) -> GPUTarget:
    return GPUTarget("hip", arch, WARP_SIZE)


def main(argv=None) -> int:
    return cc.main(argv, __doc__, ["gfx942"], target, builds)


if __name__ == "__main__":
    sys.exit(main())
