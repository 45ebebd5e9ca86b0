"""CDNA launch shapes (MI200/MI300: wavefronts of 64 lanes, MFMA matrix cores, no wgmma).

A "warp" here is a 64-lane wavefront, so a program of 4 warps is 256 lanes: tiles are sized so
each lane holds a few elements rather than the NVIDIA shapes' counts halved. P @ V runs as
``bf16x3`` (three bf16 MFMA products: within an ulp of float32 for 16-bit outputs), the fast
exact-enough option the AMD backend offers where NVIDIA's uses tf32x3.
"""

from __future__ import annotations

import dataclasses

from octavo_triton.tuning import AttentionTuning, GpuTuning, MatmulTuning, RowTuning, SamplerTuning

WARP_SIZE = 64
NUM_COMPUTE_UNITS = 304  # MI300X; the persistent RMSNorm grid

# Split-KV below about two programs per compute unit (MI300X: 304). Not yet measured on a GPU.
_ATTENTION = AttentionTuning(
    tile_n=64, pv_precision="bf16x3", split_kv_segment_len=512, split_kv_max_programs=608
)

TUNING = GpuTuning(
    attention=_ATTENTION,
    # Heads wider than 128: narrower, single-stage context tiles (a CDNA compute unit's 64 KiB
    # of LDS).
    attention_wide_heads=dataclasses.replace(_ATTENTION, tile_n=32, num_stages=1),
    sampler=SamplerTuning(block_v=4096, num_warps=8),
    rows=RowTuning(max_block=8192, bitmask_block=2048, warp_size=WARP_SIZE),
    # The Triton scaled-mm used where hipBLASLt FP8 is unavailable: MFMA-friendly 128-wide K steps.
    matmul=MatmulTuning(block_m=64, block_n=64, block_k=128, group_m=8, num_warps=4, num_stages=2),
)
