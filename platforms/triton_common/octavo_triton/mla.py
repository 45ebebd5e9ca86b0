"""Multi-head latent attention (``octavo_mla_attention_backend``) on the Triton kernels of
:mod:`mla_kernels`: one launch for the row write, one for the attention of a whole mixed batch
(prefill chunks and decodes together).

Launch sizes come from the host: the query's token count and ``metadata.num_reqs`` (and
``num_actual_tokens``), never a device read. Every head reads the same cached row, so a program
packs several heads of a token (and, for fewer heads than its rows, several tokens) into the
rows of its ``tl.dot``. There is no split of long contexts across programs: a token's result
depends only on its own request, so the batch around it never changes its numbers. Tiles not
yet measured on a GPU; the conformance suite and ``tests/platforms/cuda/test_cuda_mla.py``
check them under the interpreter.
"""

from __future__ import annotations

import dataclasses

import torch
import triton

from octavo.platform.types import AttentionMetadata, MLAAttentionBackend, MLASpec
from octavo_triton.mla_kernels import mla_attention_kernel, write_rows_kernel
from octavo_triton.runtime import interpreting, next_power_of_2, upcast_loads

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MIN_DOT = 16  # the smallest tl.dot dimension the matrix units take
_LOW_PRECISION = (torch.float16, torch.bfloat16)


@dataclasses.dataclass(frozen=True)
class MLATuning:
    """Tiles of the MLA kernels: ``block_m`` query rows per program (a power of two, at least
    16: heads of one token first, then tokens), ``tile_n`` context rows per loop step
    (``wide_tile_n`` for latents wider than 256, whose tiles would not fit in shared memory),
    ``pv_precision`` how the float32 probabilities meet the latents (``"ieee"``, or ``"low"``:
    cast to a 16-bit cache's dtype, as the attention kernel's option), ``write_tokens`` rows
    per program of the row write."""

    block_m: int = 16
    tile_n: int = 32
    wide_tile_n: int = 16
    num_warps: int = 4
    num_stages: int = 2
    pv_precision: str = "ieee"
    write_tokens: int = 1

    def for_interpreter(self) -> "MLATuning":
        """Under the interpreter a program's cost is per operation, not per element: more rows
        per program and longer context tiles."""
        return dataclasses.replace(
            self, block_m=64, tile_n=128, wide_tile_n=128, write_tokens=64, pv_precision="ieee"
        )


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def write_rows(
    kv_row: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    tokens_per_program: int = 1,
    interpret: bool = False,
) -> None:
    """Store each new token's row at its ``slot_mapping`` slot (-1 skips), for the first
    ``num_actual_tokens`` tokens when that is set (padding tokens are never written)."""
    num_slots = min(metadata.slot_mapping.shape[0], kv_row.shape[0])
    if metadata.num_actual_tokens >= 0:
        num_slots = min(num_slots, metadata.num_actual_tokens)
    if num_slots == 0:
        return
    kv_row = _unit_last(kv_row)
    width = kv_cache.shape[-1]
    write_rows_kernel[(triton.cdiv(num_slots, tokens_per_program),)](
        kv_row,
        kv_cache,
        metadata.slot_mapping,
        num_slots,
        kv_row.stride(0),
        kv_cache.stride(0),
        kv_cache.stride(1),
        WIDTH=width,
        WIDTH_PAD=next_power_of_2(width),
        BLOCK_SIZE=kv_cache.shape[1],
        BLOCK_T=tokens_per_program,
        EMULATE=kv_row.dtype != kv_cache.dtype and upcast_loads(kv_cache.dtype, interpret),
    )


class TritonMLABackend(MLAAttentionBackend):
    """Paged MLA in Triton over the contract's layout ``[num_blocks, block_size, kv_lora_rank +
    qk_rope_head_dim]`` (so the core's block copies and swaps apply unchanged), with
    ``tuning``'s tiles as given (:func:`make_mla_backend` picks the interpreter's)."""

    name = "triton-mla"

    def __init__(self, spec: MLASpec, tuning: MLATuning = MLATuning()):
        super().__init__(spec)
        if tuning.block_m < MIN_DOT or tuning.block_m & (tuning.block_m - 1):
            raise ValueError(f"MLA block_m {tuning.block_m}: use a power of two >= {MIN_DOT}")
        self.tuning = tuning
        self.interpret = interpreting()
        self.block_h = min(next_power_of_2(spec.num_heads), tuning.block_m)
        self.block_q = tuning.block_m // self.block_h
        tile_n = tuning.tile_n if spec.kv_lora_rank <= 256 else tuning.wide_tile_n
        self.tile_n = max(MIN_DOT, next_power_of_2(tile_n))
        self._constexprs: dict[tuple, dict] = {}
        self.launch_options = {}
        if not self.interpret:
            self.launch_options = {"num_warps": tuning.num_warps, "num_stages": tuning.num_stages}

    def write_rows(
        self, kv_row: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata
    ) -> None:
        """The base class's row write (the model's expanded prefill form reads the rows back
        itself), as one Triton launch."""
        write_rows(kv_row, kv_cache, metadata, self.tuning.write_tokens, self.interpret)

    def forward(  # type: ignore[override]
        self,
        query: torch.Tensor,
        kv_row: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Write the new rows, then attend through ``block_table``: ``[T, heads,
        kv_lora_rank]`` in ``query.dtype``, zeros for padding tokens."""
        spec = self.spec
        if query.dim() != 3 or tuple(query.shape[1:]) != (spec.num_heads, spec.row_width):
            raise ValueError(
                f"MLA query is {tuple(query.shape)}; pass [tokens, {spec.num_heads}, "
                f"{spec.row_width}] (latent then rotary part of each head)"
            )
        if kv_cache.shape[-1] != spec.row_width or kv_cache.stride(-1) != 1:
            raise ValueError(
                f"MLA cache is {tuple(kv_cache.shape)} with strides {kv_cache.stride()}; "
                f"allocate kv_cache_shape(num_blocks), contiguous rows of {spec.row_width}"
            )
        self.write_rows(kv_row, kv_cache, metadata)
        out = query.new_zeros(query.shape[0], spec.num_heads, spec.kv_lora_rank)
        num_tokens = query.shape[0]
        if metadata.num_actual_tokens >= 0:
            num_tokens = min(num_tokens, metadata.num_actual_tokens)
        if metadata.num_reqs == 0 or num_tokens == 0:
            return out
        self._launch(out, _unit_last(query), kv_cache, metadata, num_tokens)
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
            spec = self.spec
            self._constexprs[key] = dict(
                LATENT=spec.kv_lora_rank,
                LATENT_PAD=max(MIN_DOT, next_power_of_2(spec.kv_lora_rank)),
                ROPE=spec.qk_rope_head_dim,
                ROPE_PAD=max(MIN_DOT, next_power_of_2(spec.qk_rope_head_dim)),
                BLOCK_SIZE=block_size,
                BLOCK_H=self.block_h,
                BLOCK_Q=self.block_q,
                TILE_N=self.tile_n,
                UPCAST=upcast,
                PV_PRECISION=pv_precision,
            )
        return self._constexprs[key]

    def _launch(self, out, query, kv_cache, metadata: AttentionMetadata, num_tokens: int):
        num_reqs, block_table = metadata.num_reqs, metadata.block_table
        grid = (
            num_tokens // self.block_q + num_reqs,
            triton.cdiv(self.spec.num_heads, self.block_h),
        )
        mla_attention_kernel[grid](
            out,
            query,
            kv_cache,
            block_table,
            metadata.seq_lens,
            metadata.query_start_loc,
            float(self.spec.scale),
            num_reqs,
            self.spec.num_heads,
            query.stride(0),
            query.stride(1),
            out.stride(0),
            out.stride(1),
            block_table.stride(0),
            kv_cache.stride(0),
            kv_cache.stride(1),
            **self.kernel_constexprs(query.dtype, kv_cache.dtype, kv_cache.shape[1]),
            **self.launch_options,
        )


def make_mla_backend(spec: MLASpec, tuning: MLATuning = MLATuning()) -> TritonMLABackend:
    """The hook's backend for ``spec`` (``tuning.for_interpreter()`` under the interpreter)."""
    if spec.dtype not in DTYPES:
        raise ValueError(
            f"the Triton MLA backend takes {', '.join(map(str, DTYPES))}, not {spec.dtype}"
        )
    return TritonMLABackend(spec, tuning.for_interpreter() if interpreting() else tuning)
