"""Batched multi-LoRA products: each token of a step reads its own slot's adapter.

``shrink(x [T, K], a_stacked [S, R, K], mapping) -> [T, R]`` float32 and ``expand(y, buffer
[T, R], b_stacked [S, N, R], mapping, offset)`` (``y[t, offset : offset + N] += buffer[t] @
B[slot(t)].T`` in float32, rounded once into ``y``'s dtype), as ``octavo.ops.reference.lora_shrink``
/ ``lora_expand``. Two launch shapes of each:

- by token (BGMV): one program per token and block of outputs; it reads the token's slot from
  ``mapping.token_slots`` and skips the base model's tokens (slot -1). Products are
  broadcast-multiplies reduced in float32: no matrix units, right for decode steps, where a
  slot holds a token or two.
- by segment (SGMV): one program per tile of ``BLOCK_M`` tokens of one slot (a segment of
  ``mapping.sorted_tokens``) and block of outputs, with ``tl.dot``: the adapter's tile is read
  once for the whole tile of tokens, right for prefill. The grid covers the longest segment
  (``mapping.max_segment_length``, on the host); tiles past a shorter segment's end do nothing.

Each call picks the segment shape when the longest segment reaches
``LoRATuning.segment_min_length`` tokens. Shapes and strides are runtime arguments (one compile
per dtype and block sizes, not per step); nothing reads the mapping's device tensors on the host.
Float32 operands of ``tl.dot`` are multiplied in IEEE float32 (no TF32).
"""

from __future__ import annotations

import dataclasses

import torch
import triton

from octavo.platform.types import LoRAMapping
from octavo_triton.lora_kernels import (
    segment_expand_kernel,
    segment_shrink_kernel,
    token_expand_kernel,
    token_shrink_kernel,
)
from octavo_triton.runtime import interpreting, next_power_of_2, upcast_loads

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MIN_DOT = 16  # the smallest tl.dot dimension the matrix units take


@dataclasses.dataclass(frozen=True)
class LoRATuning:
    """Blocks of the LoRA kernels. By token: ``token_block_r`` ranks x ``token_block_k`` inputs
    per shrink step, ``token_block_n`` outputs x ``token_block_r`` ranks per expand step. By
    segment: ``segment_block_m`` tokens per tile, ``segment_block_n`` outputs (expand) or
    ``segment_block_r`` ranks (shrink) per program, ``segment_block_k`` inputs per shrink step;
    the expand walks the rank in ``segment_block_r`` steps too. A step whose longest segment has
    ``segment_min_length`` tokens or more goes by segment. Not yet measured on a GPU."""

    token_block_r: int = 16
    token_block_k: int = 256
    token_block_n: int = 128
    segment_block_m: int = 32
    segment_block_n: int = 64
    segment_block_r: int = 64
    segment_block_k: int = 64
    segment_min_length: int = 16
    num_warps: int = 4
    num_stages: int = 2

    def for_interpreter(self) -> "LoRATuning":
        """Under the interpreter a program's cost is per operation, not per element: big blocks,
        and the segment shape from segments of two tokens (the suite covers both shapes)."""
        return dataclasses.replace(
            self,
            token_block_r=64,
            token_block_k=1024,
            token_block_n=1024,
            segment_block_m=64,
            segment_block_n=512,
            segment_block_k=512,
            segment_min_length=2,
        )


# --- by token (BGMV) -------------------------------------------------------------------------


def check_shrink(x: torch.Tensor, a_stacked: torch.Tensor, mapping: LoRAMapping) -> None:
    """Raise when ``x [T, K]`` and ``a_stacked [S, R, K]`` do not fit each other or the step."""
    if x.dim() != 2 or a_stacked.dim() != 3 or x.shape[1] != a_stacked.shape[2]:
        raise ValueError(
            f"lora shrink: x is {tuple(x.shape)} and a_stacked {tuple(a_stacked.shape)}; "
            "pass x as [tokens, K] and a_stacked as [slots, rank, K]"
        )
    if x.shape[0] != mapping.num_tokens:
        raise ValueError(
            f"lora shrink: x has {x.shape[0]} rows but the mapping {mapping.num_tokens} tokens; "
            "build the mapping from this step's tokens"
        )


def check_expand(
    y: torch.Tensor,
    buffer: torch.Tensor,
    b_stacked: torch.Tensor,
    mapping: LoRAMapping,
    offset: int,
) -> None:
    """Raise when ``y``, ``buffer [T, R]`` and ``b_stacked [S, N, R]`` do not fit together."""
    if buffer.dim() != 2 or b_stacked.dim() != 3 or buffer.shape[1] != b_stacked.shape[2]:
        raise ValueError(
            f"lora expand: buffer is {tuple(buffer.shape)} and b_stacked "
            f"{tuple(b_stacked.shape)}; pass buffer as [tokens, rank] and b_stacked as "
            "[slots, N, rank]"
        )
    if y.dim() != 2 or offset < 0 or y.shape[1] < offset + b_stacked.shape[1]:
        raise ValueError(
            f"lora expand: y is {tuple(y.shape)}, too narrow for columns [{offset}, "
            f"{offset + b_stacked.shape[1]}); pass the whole fused output and its offset"
        )
    if not y.shape[0] == buffer.shape[0] == mapping.num_tokens:
        raise ValueError(
            f"lora expand: y has {y.shape[0]} rows, buffer {buffer.shape[0]}, the mapping "
            f"{mapping.num_tokens} tokens; build the mapping from this step's tokens"
        )


class TritonLoRAKernels:
    """The Triton ``LoRAKernels`` of a model of ``dtype`` with ``tuning``'s blocks, as given
    (:func:`make_lora_kernels` picks the interpreter's): :meth:`shrink` and :meth:`expand` pick
    the by-token or by-segment kernels per call; the four are public for tests."""

    def __init__(self, dtype: torch.dtype, tuning: LoRATuning = LoRATuning()):
        if dtype not in DTYPES:
            raise ValueError(
                f"the Triton LoRA kernels take models in {', '.join(map(str, DTYPES))}, not "
                f"{dtype}; run the model in one of them or without --enable-lora"
            )
        self.dtype = dtype
        self.interpret = interpreting()
        self.tuning = tuning
        self.launch = {}
        if not self.interpret:
            self.launch = {"num_warps": self.tuning.num_warps, "num_stages": self.tuning.num_stages}

    def by_segment(self, mapping: LoRAMapping) -> bool:
        """Whether a step goes by segment: its longest segment fills enough of a tile."""
        return mapping.max_segment_length >= self.tuning.segment_min_length

    def shrink(
        self, x: torch.Tensor, a_stacked: torch.Tensor, mapping: LoRAMapping
    ) -> torch.Tensor:
        """``[T, R]`` float32: ``x[t] @ a_stacked[slot(t)].T``, zeros without an adapter."""
        check_shrink(x, a_stacked, mapping)
        if self.by_segment(mapping):
            return self.shrink_by_segment(x, a_stacked, mapping)
        return self.shrink_by_token(x, a_stacked, mapping)

    def expand(
        self,
        y: torch.Tensor,
        buffer: torch.Tensor,
        b_stacked: torch.Tensor,
        mapping: LoRAMapping,
        offset: int,
    ) -> None:
        """``y[t, offset : offset + N] += buffer[t] @ b_stacked[slot(t)].T`` in place, in
        float32 rounded once, for the tokens with an adapter."""
        check_expand(y, buffer, b_stacked, mapping, offset)
        if self.by_segment(mapping):
            self.expand_by_segment(y, buffer, b_stacked, mapping, offset)
        else:
            self.expand_by_token(y, buffer, b_stacked, mapping, offset)

    def shrink_by_token(
        self, x: torch.Tensor, a_stacked: torch.Tensor, mapping: LoRAMapping
    ) -> torch.Tensor:
        """:meth:`shrink` with one program per token and block of ranks."""
        (num_tokens, k), rank = x.shape, a_stacked.shape[1]
        out = torch.empty(num_tokens, rank, dtype=torch.float32, device=x.device)
        if num_tokens == 0 or rank == 0:
            return out
        block_r = min(self.tuning.token_block_r, next_power_of_2(rank))
        token_shrink_kernel[(num_tokens, triton.cdiv(rank, block_r))](
            out,
            x,
            a_stacked,
            mapping.token_slots,
            k,
            rank,
            *x.stride(),
            *a_stacked.stride(),
            *out.stride(),
            BLOCK_R=block_r,
            BLOCK_K=min(self.tuning.token_block_k, next_power_of_2(k)),
            **self.launch,
        )
        return out

    def expand_by_token(
        self,
        y: torch.Tensor,
        buffer: torch.Tensor,
        b_stacked: torch.Tensor,
        mapping: LoRAMapping,
        offset: int,
    ) -> None:
        """:meth:`expand` with one program per token and block of output columns."""
        num_tokens, (_, n, rank) = y.shape[0], b_stacked.shape
        if not mapping.host_segment_slots or n == 0:
            return
        block_n = min(self.tuning.token_block_n, next_power_of_2(n))
        token_expand_kernel[(num_tokens, triton.cdiv(n, block_n))](
            y,
            buffer,
            b_stacked,
            mapping.token_slots,
            n,
            rank,
            offset,
            *y.stride(),
            *buffer.stride(),
            *b_stacked.stride(),
            BLOCK_N=block_n,
            BLOCK_R=min(self.tuning.token_block_r, next_power_of_2(rank)),
            EMULATE=upcast_loads(y.dtype, self.interpret),
            **self.launch,
        )

    def segment_grid(self, mapping: LoRAMapping, outputs: int, block: int) -> tuple[int, ...]:
        """``(segments, tiles of the longest, blocks of outputs)`` from the host's mapping."""
        tiles = triton.cdiv(mapping.max_segment_length, self.tuning.segment_block_m)
        return len(mapping.host_segment_slots), tiles, triton.cdiv(outputs, block)

    def shrink_by_segment(
        self, x: torch.Tensor, a_stacked: torch.Tensor, mapping: LoRAMapping
    ) -> torch.Tensor:
        """:meth:`shrink` with one program per tile of a segment's tokens and block of ranks."""
        (num_tokens, k), rank = x.shape, a_stacked.shape[1]
        out = torch.zeros(num_tokens, rank, dtype=torch.float32, device=x.device)
        if not mapping.host_segment_slots or rank == 0:
            return out
        block_r = max(MIN_DOT, min(self.tuning.segment_block_r, next_power_of_2(rank)))
        upcast = x.dtype != a_stacked.dtype or upcast_loads(x.dtype, self.interpret)
        segment_shrink_kernel[self.segment_grid(mapping, rank, block_r)](
            out,
            x,
            a_stacked,
            mapping.sorted_tokens,
            mapping.segment_slots,
            mapping.segment_starts,
            k,
            rank,
            *x.stride(),
            *a_stacked.stride(),
            *out.stride(),
            UPCAST=upcast or upcast_loads(a_stacked.dtype, self.interpret),
            BLOCK_M=self.tuning.segment_block_m,
            BLOCK_R=block_r,
            BLOCK_K=max(MIN_DOT, min(self.tuning.segment_block_k, next_power_of_2(k))),
            **self.launch,
        )
        return out

    def expand_by_segment(
        self,
        y: torch.Tensor,
        buffer: torch.Tensor,
        b_stacked: torch.Tensor,
        mapping: LoRAMapping,
        offset: int,
    ) -> None:
        """:meth:`expand` with one program per tile of a segment's tokens and block of output
        columns."""
        _, n, rank = b_stacked.shape
        if not mapping.host_segment_slots or n == 0:
            return
        block_n = max(MIN_DOT, min(self.tuning.segment_block_n, next_power_of_2(n)))
        segment_expand_kernel[self.segment_grid(mapping, n, block_n)](
            y,
            buffer,
            b_stacked,
            mapping.sorted_tokens,
            mapping.segment_slots,
            mapping.segment_starts,
            n,
            rank,
            offset,
            *y.stride(),
            *buffer.stride(),
            *b_stacked.stride(),
            BLOCK_M=self.tuning.segment_block_m,
            BLOCK_N=block_n,
            BLOCK_R=max(MIN_DOT, min(self.tuning.segment_block_r, next_power_of_2(rank))),
            EMULATE=upcast_loads(y.dtype, self.interpret),
            **self.launch,
        )


def make_lora_kernels(dtype: torch.dtype, tuning: LoRATuning = LoRATuning()) -> TritonLoRAKernels:
    """The hook's ``LoRAKernels`` for a model of ``dtype`` (``tuning.for_interpreter()`` under
    the interpreter)."""
    return TritonLoRAKernels(dtype, tuning.for_interpreter() if interpreting() else tuning)
