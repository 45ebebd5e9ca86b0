"""Launch shapes: what a platform chooses for its chips when it reuses a shared kernel."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class AttentionTuning:
    """Tile shapes of the unified paged-attention kernel.

    ``block_m`` rows of a program's query tile hold ``block_m // gqa`` new tokens times the
    ``gqa`` query heads that share one KV head; ``tile_n`` context tokens are read per loop
    step (any multiple of 16, independent of the KV block size: keys are gathered slot by slot
    through the block table). ``pv_precision`` is how probabilities (float32) meet V: a ``tl.dot``
    input precision on float32 operands (``"ieee"``, NVIDIA's ``"tf32x3"``, AMD's ``"bf16x3"``:
    within one output ulp of the float32 reference) or ``"low"`` (probabilities cast to the KV
    dtype, the usual flash-attention shortcut: faster, a few 16-bit ulps off near zero).
    ``kv_write_tokens`` new tokens are written per program of the KV write.
    """

    block_m: int = 16
    tile_n: int = 32
    num_warps: int = 4
    num_stages: int = 2
    pv_precision: str = "ieee"
    kv_write_tokens: int = 1
    # Split-KV: a batch of short queries (decodes) with fewer than ``split_kv_max_programs``
    # programs splits contexts longer than ``split_kv_segment_len`` into up to
    # ``split_kv_max_segments`` segments walked in parallel (0 turns it off).
    split_kv_segment_len: int = 0
    split_kv_max_segments: int = 16
    split_kv_max_programs: int = 0
    # Under the interpreter a program's cost is per operation, not per element: bigger tiles,
    # and split-KV whenever it applies, so the conformance suite covers it.
    interpreter_block_m: int = 64
    interpreter_tile_n: int = 128
    interpreter_kv_write_tokens: int = 64
    interpreter_split_kv_segment_len: int = 64

    def for_interpreter(self) -> "AttentionTuning":
        """The shapes to use when kernels run in the Triton interpreter."""
        return dataclasses.replace(
            self,
            block_m=self.interpreter_block_m,
            tile_n=self.interpreter_tile_n,
            kv_write_tokens=self.interpreter_kv_write_tokens,
            split_kv_segment_len=self.interpreter_split_kv_segment_len,
            split_kv_max_programs=1 << 30,
        )


@dataclasses.dataclass(frozen=True)
class SamplerTuning:
    """Chunks of the sampling kernel: ``block_r`` rows per program (1 on GPUs: vocabularies are
    large), ``interpreter_block_r`` under the interpreter (whose cost is per operation, not per
    element), ``block_v`` tokens per loop step."""

    block_v: int = 1024
    num_warps: int = 4
    block_r: int = 1
    interpreter_block_r: int = 64


@dataclasses.dataclass(frozen=True)
class RowTuning:
    """Row-wise kernels (RMSNorm, bitmask): the most columns one program handles in a block."""

    max_block: int = 65536
    bitmask_block: int = 1024
    warp_size: int = 32


@dataclasses.dataclass(frozen=True)
class MatmulTuning:
    """Tiles of the FP8 scaled matmul (``block_k`` of 64+ feeds FP8 matrix units full K)."""

    block_m: int = 64
    block_n: int = 64
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3


@dataclasses.dataclass(frozen=True)
class GpuTuning:
    """One GPU platform's launch shapes for every shared kernel: what ``octavo_triton.platform``
    builds the kernels with. Heads wider than 128 take ``attention_wide_heads`` (narrower
    context tiles: their K/V tiles would not fit in shared memory)."""

    attention: AttentionTuning
    attention_wide_heads: AttentionTuning
    sampler: SamplerTuning
    rows: RowTuning
    matmul: MatmulTuning

    def attention_for(self, head_dim: int) -> AttentionTuning:
        """The attention tiles for a model whose heads are ``head_dim`` wide."""
        return self.attention if head_dim <= 128 else self.attention_wide_heads
