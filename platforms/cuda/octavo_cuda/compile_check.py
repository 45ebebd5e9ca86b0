"""Compile the cuda platform's kernels, with its own tuning, for sm_80 and sm_90 (no GPU needed).

    python -m octavo_cuda.compile_check [--arch 80 --arch 90]

Runs without ``TRITON_INTERPRET``; exits non-zero naming the first kernel that fails.
"""

from __future__ import annotations

import argparse
import sys

import torch
from triton.backends.compiler import GPUTarget

from octavo.platform.types import AttentionSpec
from octavo_cuda import tuning
from octavo_triton import compile_check as cc

# Llama-3-8B (GQA 4, head 128), a wide-head model (head 256, MQA) and a sliding-window one.
SPECS = (
    ("llama-h128", AttentionSpec(32, 8, 128, torch.float16, 16, 128**-0.5)),
    ("wide-h256", AttentionSpec(8, 1, 256, torch.bfloat16, 16, 256**-0.5)),
    ("window-h64", AttentionSpec(16, 4, 64, torch.float16, 32, 64**-0.5, sliding_window=4096)),
)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def builds(arch: int = 90) -> list[cc.KernelBuild]:
    """Every kernel the cuda platform launches on ``arch``, in the specialisations models use."""
    out = []
    for name, spec in SPECS:
        dtypes = DTYPES if name == "llama-h128" else (spec.dtype,)
        for dtype in dtypes:
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
        out += cc.rms_norm_builds(4096, dtype, tuning.ROWS)
    out += cc.sampler_builds(tuning.SAMPLER)
    out += cc.rejection_sampler_builds(tuning.SAMPLER)
    out += cc.bitmask_builds(tuning.ROWS)
    out += cc.fp8_builds(tuning.MATMUL, "fp8e4nv", widen=arch < tuning.FP8_MMA_ARCH)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--arch", type=int, action="append", help="compute capability, e.g. 80 (repeatable)"
    )
    args = parser.parse_args(argv)
    for arch in args.arch or [80, 90]:
        for record in cc.compile_builds(builds(arch), GPUTarget("cuda", arch, 32)):
            print(
                f"{record['target']:10} {record['kernel']:45} {'+'.join(record['stages']):10} "
                f"shared {record['shared_bytes']} B"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
