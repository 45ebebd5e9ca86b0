"""NVIDIA launch shapes for the shared Triton kernels (warps of 32 threads, mma tensor cores).

Chosen for sm_80/sm_90 from the kernels' register and shared-memory needs; ``ci/device-check.sh``
is where they get measured on a real GPU.
"""

from __future__ import annotations

import dataclasses

from octavo_triton.tuning import AttentionTuning, GpuTuning, MatmulTuning, RowTuning, SamplerTuning

# Rows of a program: 16 is the smallest mma M; tf32x3 keeps P @ V within an ulp of float32.
# Split-KV when a decode batch launches fewer programs than about two per SM (A100: 108,
# H100: 132), in segments of 512 context tokens. Not yet measured on a GPU.
_ATTENTION = AttentionTuning(
    block_m=16,
    tile_n=64,
    pv_precision="tf32x3",
    split_kv_segment_len=512,
    split_kv_max_programs=256,
)

TUNING = GpuTuning(
    attention=_ATTENTION,
    attention_wide_heads=dataclasses.replace(_ATTENTION, tile_n=32),
    sampler=SamplerTuning(block_v=2048, num_warps=8),
    rows=RowTuning(max_block=65536, bitmask_block=1024, warp_size=32),
    matmul=MatmulTuning(block_m=64, block_n=128, block_k=64, group_m=8, num_warps=4, num_stages=3),
)

FP8_MMA_ARCH = 89  # Ada and Hopper multiply e4m3 natively; Ampere widens it to float16
