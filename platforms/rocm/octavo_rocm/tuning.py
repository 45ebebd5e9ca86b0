"""CDNA launch shapes (MI200/MI300: wavefronts of 64 lanes, MFMA matrix cores, no wgmma).

A "warp" here is a 64-lane wavefront, so a program of 4 warps is 256 lanes: tiles are sized so
each lane holds a few elements rather than the NVIDIA shapes' counts halved. P @ V runs as
``bf16x3`` (three bf16 MFMA products: within an ulp of float32 for 16-bit outputs), the fast
exact-enough option the AMD backend offers where NVIDIA's uses tf32x3.
"""

from __future__ import annotations

from octavo.platform.types import AttentionSpec
from octavo_triton.tuning import AttentionTuning, MatmulTuning, RowTuning, SamplerTuning

WARP_SIZE = 64
NUM_COMPUTE_UNITS = 304  # MI300X; the persistent RMSNorm grid

# Split-KV below about two programs per compute unit (MI300X: 304). Not yet measured on a GPU.
_SPLIT_KV = dict(split_kv_segment_len=512, split_kv_max_segments=16, split_kv_max_programs=608)
_ATTENTION = AttentionTuning(
    block_m=16, tile_n=64, num_warps=4, num_stages=2, pv_precision="bf16x3", **_SPLIT_KV
)
_ATTENTION_WIDE_HEADS = AttentionTuning(
    block_m=16, tile_n=32, num_warps=4, num_stages=1, pv_precision="bf16x3", **_SPLIT_KV
)

SAMPLER = SamplerTuning(block_v=4096, num_warps=8)
ROWS = RowTuning(max_block=8192, bitmask_block=2048, warp_size=WARP_SIZE)
# The Triton scaled-mm used where hipBLASLt FP8 is unavailable: MFMA-friendly 128-wide K steps.
MATMUL = MatmulTuning(block_m=64, block_n=64, block_k=128, group_m=8, num_warps=4, num_stages=2)


def attention_tuning(spec: AttentionSpec) -> AttentionTuning:
    """Tiles for one model's attention: narrower, single-stage context tiles for heads wider than
    128 (the 64 KiB LDS of a CDNA compute unit)."""
    return _ATTENTION if spec.head_dim <= 128 else _ATTENTION_WIDE_HEADS
