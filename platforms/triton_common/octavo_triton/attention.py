"""The paged-attention backend built on the Triton kernels of :mod:`attention_kernels`."""

from __future__ import annotations

import torch
import triton

from octavo.platform.types import AttentionBackend, AttentionMetadata, AttentionSpec
from octavo_triton.attention_kernels import (
    merge_segments_kernel,
    unified_attention_kernel,
    write_kv_kernel,
)
from octavo_triton.runtime import interpreting, next_power_of_2, upcast_loads
from octavo_triton.tuning import AttentionTuning

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    tokens_per_program: int = 1,
    interpret: bool | None = None,
) -> None:
    """Store the new tokens' K/V at ``slot_mapping`` (``-1`` skips) in the default layout."""
    num_slots = slot_mapping.shape[0]
    if num_slots == 0:
        return
    key, value = _unit_last(key), _unit_last(value)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    write_kv_kernel[(triton.cdiv(num_slots, tokens_per_program),)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        num_slots,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        HEADS_PAD=next_power_of_2(num_kv_heads),
        HEAD_DIM_PAD=next_power_of_2(head_dim),
        BLOCK_T=tokens_per_program,
        EMULATE_BF16=key.dtype != kv_cache.dtype and upcast_loads(kv_cache.dtype),
    )


class TritonAttentionBackend(AttentionBackend):
    """Unified paged attention in Triton: one launch for a batch of prefill chunks and decodes.

    Keeps octavo's default KV layout ``[2, num_blocks, block_size, num_kv_heads, head_dim]``, so
    the core's block copies and swaps apply unchanged. ``tuning`` holds the platform's tile shapes.
    """

    name = "triton"

    def __init__(self, spec: AttentionSpec, tuning: AttentionTuning = AttentionTuning()):
        super().__init__(spec)
        if spec.num_heads % spec.num_kv_heads:
            raise ValueError(
                f"num_heads ({spec.num_heads}) must be a multiple of num_kv_heads "
                f"({spec.num_kv_heads})"
            )
        self.interpret = interpreting()
        self.tuning = tuning = tuning.for_interpreter() if self.interpret else tuning
        self.gqa = spec.num_heads // spec.num_kv_heads
        self.block_m = max(tuning.block_m, next_power_of_2(self.gqa))
        self.block_q = self.block_m // self.gqa
        self.head_dim_pad = max(16, next_power_of_2(spec.head_dim))
        self.sliding_window = spec.sliding_window or 0
        self._constexprs: dict[tuple, dict] = {}
        self.launch_options = {}
        if not self.interpret:
            self.launch_options = {"num_warps": tuning.num_warps, "num_stages": tuning.num_stages}

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Write the new K/V through ``slot_mapping``, then attend through ``block_table``."""
        write_kv(
            key, value, kv_cache, metadata.slot_mapping, self.tuning.kv_write_tokens, self.interpret
        )
        out = torch.zeros_like(query)
        num_reqs = metadata.num_reqs
        if num_reqs == 0 or query.shape[0] == 0:
            return out
        query = _unit_last(query)
        self._launch(out, query, kv_cache, metadata, num_reqs)
        return out

    def kernel_constexprs(
        self, query_dtype: torch.dtype, kv_dtype: torch.dtype, block_size: int
    ) -> dict:
        """The attention kernel's compile-time arguments for these dtypes (also what the
        compilation checks build); worked out once per combination."""
        key = (query_dtype, kv_dtype, block_size)
        if key not in self._constexprs:
            upcast = (
                upcast_loads(query_dtype, self.interpret)
                or upcast_loads(kv_dtype, self.interpret)
                or query_dtype != kv_dtype
            )
            pv_precision = self.tuning.pv_precision
            if pv_precision == "low" and (upcast or kv_dtype not in _LOW_PRECISION):
                pv_precision = "ieee"
            if self.interpret and pv_precision != "low":
                pv_precision = "ieee"  # the interpreter multiplies exactly and knows no bf16x3
            self._constexprs[key] = dict(
                GQA=self.gqa,
                SLIDING_WINDOW=self.sliding_window,
                BLOCK_SIZE=block_size,
                HEAD_DIM=self.spec.head_dim,
                HEAD_DIM_PAD=self.head_dim_pad,
                BLOCK_M=self.block_m,
                BLOCK_Q=self.block_q,
                TILE_N=self.tuning.tile_n,
                UPCAST=upcast,
                PV_PRECISION=pv_precision,
            )
        return self._constexprs[key]

    def num_segments(self, metadata: AttentionMetadata, num_tokens: int) -> int:
        """Split-KV segments for this batch (1: no split), from host scalars only: short
        queries only, too few programs to fill the GPU, and a context worth splitting."""
        t = self.tuning
        if t.split_kv_segment_len <= 0 or metadata.max_query_len > self.block_q:
            return 1
        programs = (num_tokens // self.block_q + metadata.num_reqs) * self.spec.num_kv_heads
        if programs >= t.split_kv_max_programs:
            return 1
        return max(
            1,
            min(t.split_kv_max_segments, triton.cdiv(metadata.max_seq_len, t.split_kv_segment_len)),
        )

    def _launch(self, out, query, kv_cache, metadata: AttentionMetadata, num_reqs: int) -> None:
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        block_table = metadata.block_table
        num_tokens, num_heads = query.shape[0], self.spec.num_heads
        segments = self.num_segments(metadata, num_tokens)
        segment_len = self.tuning.split_kv_segment_len
        if segments > 1:
            # every segment but the last is a whole number of tiles; the last runs to the end
            tile = self.tuning.tile_n
            segment_len = triton.cdiv(triton.cdiv(metadata.max_seq_len, segments), tile) * tile
            shape = (num_tokens, num_heads, segments)
            partial = torch.empty(*shape, self.head_dim_pad, dtype=torch.float32, device=out.device)
            maxima = torch.empty(shape, dtype=torch.float32, device=out.device)
            sums = torch.empty_like(maxima)
        else:
            partial = maxima = sums = out  # unused
        grid = (num_tokens // self.block_q + num_reqs, self.spec.num_kv_heads, segments)
        unified_attention_kernel[grid](
            out,
            query,
            k_cache,
            v_cache,
            block_table,
            metadata.seq_lens,
            metadata.query_start_loc,
            float(self.spec.scale),
            num_reqs,
            query.stride(0),
            query.stride(1),
            out.stride(0),
            out.stride(1),
            block_table.stride(0),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            v_cache.stride(0),
            v_cache.stride(1),
            v_cache.stride(2),
            partial,
            maxima,
            sums,
            max(segment_len, 1),
            **self.kernel_constexprs(query.dtype, kv_cache.dtype, k_cache.shape[1]),
            NUM_SEGMENTS=segments,
            **self.launch_options,
        )
        if segments > 1:
            merge_segments_kernel[(num_tokens, num_heads)](
                out,
                partial,
                maxima,
                sums,
                metadata.query_start_loc,
                num_reqs,
                num_heads,
                out.stride(0),
                out.stride(1),
                NUM_SEGMENTS=segments,
                SEGMENTS_PAD=max(2, next_power_of_2(segments)),
                HEAD_DIM=self.spec.head_dim,
                HEAD_DIM_PAD=self.head_dim_pad,
                EMULATE=upcast_loads(out.dtype, self.interpret),
            )
