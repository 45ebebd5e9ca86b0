"""The fused Mixture-of-Experts layer (``octavo_fused_moe``) on two grouped-GEMM Triton kernels.

One call of :class:`TritonFusedMoE` for a step of ``T`` tokens:

1. routing in torch: ``octavo.ops.reference.select_experts`` (the oracle's own choice, so the
   same experts are chosen), the weights rounded to the model dtype as the reference does;
2. the ``M = T * top_k`` (token, expert) pairs sorted by expert into blocks of ``block_m`` pairs
   of one expert each (:func:`align_to_blocks`, torch ops, no host sync), an expert's last
   block padded;
3. ``gate_up_kernel``: ``silu(gate) * up`` per pair ``[M, I]``, in the model dtype;
4. ``down_kernel``: each pair's ``w2`` product times its routing weight ``[M, H]``;
5. each token's sum over its ``top_k`` pairs in float32, rounded once to the model dtype.

Nothing is read back to the host: the grid covers the most blocks a step of ``M`` pairs can
need and the blocks past the last expert's do nothing. The packed weights are the model's
stacks as they are (read through their strides, never written). Tiles not yet measured on a
GPU; the conformance suite and ``tests/platforms/cuda/test_cuda_fused_moe.py`` check them
under the interpreter and compile them for sm_80, sm_90 and gfx942.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import triton

from octavo.ops import reference
from octavo.platform.types import FusedMoEFn, FusedMoEPacker, MoESpec
from octavo_triton.fused_moe_kernels import down_kernel, gate_up_kernel
from octavo_triton.runtime import interpreting, next_power_of_2, upcast_loads

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MIN_DOT = 16  # the smallest tl.dot dimension the matrix units take


@dataclasses.dataclass(frozen=True)
class MoETuning:
    """Tiles of the two grouped GEMMs: ``block_m`` pairs per block (``small_block_m`` for a
    step whose pairs average at most that many per expert: decodes, short prefills),
    ``block_n`` outputs and ``block_k`` inputs per step (each capped at the layer's widths),
    ``group_m`` blocks per tile of outputs in the grouped launch order."""

    block_m: int = 64
    small_block_m: int = 16
    block_n: int = 64
    block_k: int = 32
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 2

    def for_interpreter(self) -> "MoETuning":
        """Under the interpreter a program's cost is per operation, not per element: whole
        widths per program where they fit."""
        return dataclasses.replace(self, block_m=32, block_n=256, block_k=256)

    def block_m_for(self, num_pairs: int, num_experts: int) -> int:
        """The block of pairs for a step of ``num_pairs`` pairs over ``num_experts`` experts."""
        return self.small_block_m if num_pairs <= num_experts * self.small_block_m else self.block_m


def dot_block(width: int, block: int) -> int:
    """``block`` narrowed to ``width`` (a power of two, at least :data:`MIN_DOT`)."""
    return max(MIN_DOT, min(block, next_power_of_2(width)))


def align_to_blocks(
    expert_ids: torch.Tensor, num_experts: int, block_m: int, expert_range: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sorted_pairs [num_blocks * block_m] int64, block_experts [num_blocks] int64)`` of
    ``expert_ids [T, top_k]``: the pair ids ``t * top_k + k`` grouped by expert in ascending
    order (pairs of one expert in pair order), each expert's run starting a block and padded
    to whole blocks with the id ``M``; ``block_experts[b]`` block ``b``'s expert,
    ``num_experts`` for the blocks past the last. ``num_blocks`` is the most ``M`` pairs can
    fill, known on the host; ``expert_range`` is ``arange(num_experts + 1)`` on the device."""
    flat = expert_ids.reshape(-1)
    num_pairs = flat.numel()
    num_blocks = (num_pairs + min(num_experts, num_pairs) * (block_m - 1)) // block_m
    experts_sorted, order = torch.sort(flat, stable=True)
    bounds = torch.searchsorted(experts_sorted, expert_range)  # each expert's first position
    counts = bounds[1:] - bounds[:-1]
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = padded.cumsum(0)
    shift = padded_ends - padded - bounds[:-1]  # an expert's padded start minus its start
    positions = torch.arange(num_pairs, device=flat.device) + shift[experts_sorted]
    sorted_pairs = torch.full(
        (num_blocks * block_m,), num_pairs, dtype=torch.int64, device=flat.device
    )
    sorted_pairs.scatter_(0, positions, order)
    block_starts = torch.arange(0, num_blocks * block_m, block_m, device=flat.device)
    block_experts = torch.searchsorted(padded_ends, block_starts, right=True)
    return sorted_pairs, block_experts


def check_weights(spec: MoESpec, w13: torch.Tensor, w2: torch.Tensor) -> None:
    """Raise when ``w13``/``w2`` are not ``spec``'s ``[E, 2I, H]``/``[E, H, I]`` stacks in its
    dtype on one device."""
    e, h, i = spec.num_experts, spec.hidden_size, spec.intermediate_size
    if tuple(w13.shape) != (e, 2 * i, h) or tuple(w2.shape) != (e, h, i):
        raise ValueError(
            f"fused_moe: w13 is {tuple(w13.shape)} and w2 {tuple(w2.shape)}; pass the stacked "
            f"experts as w13 [{e}, {2 * i}, {h}] (gate rows, then up rows) and w2 [{e}, {h}, {i}]"
        )
    if w13.dtype != spec.dtype or w2.dtype != spec.dtype or w13.device != w2.device:
        raise ValueError(
            f"fused_moe: w13 is {w13.dtype} on {w13.device}, w2 {w2.dtype} on {w2.device}; "
            f"pack both in the model's dtype {spec.dtype} on its device"
        )


class TritonFusedMoE:
    """One MoE layer of ``spec`` over its packed ``w13``/``w2`` (a ``FusedMoEFn``) with
    ``tuning``'s tiles, as given (:func:`make_fused_moe` picks the interpreter's)."""

    def __init__(self, spec: MoESpec, w13: torch.Tensor, w2: torch.Tensor, tuning: MoETuning):
        check_weights(spec, w13, w2)
        self.spec, self.w13, self.w2, self.tuning = spec, w13, w2, tuning
        self.interpret = interpreting()
        self.upcast = upcast_loads(spec.dtype, self.interpret)
        self.expert_range = torch.arange(spec.num_experts + 1, device=w13.device)
        self.launch = {}
        if not self.interpret:
            self.launch = {"num_warps": tuning.num_warps, "num_stages": tuning.num_stages}

    def __call__(
        self,
        hidden: torch.Tensor,
        router_logits: torch.Tensor,
        correction_bias: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """``[T, H]`` in the model dtype: each token's experts' outputs times their weights."""
        spec = self.spec
        if hidden.dim() != 2 or hidden.shape[1] != spec.hidden_size or hidden.dtype != spec.dtype:
            raise ValueError(
                f"fused_moe: hidden is {tuple(hidden.shape)} {hidden.dtype}; pass [tokens, "
                f"{spec.hidden_size}] in the model's dtype {spec.dtype}"
            )
        num_tokens, top_k = hidden.shape[0], spec.top_k
        if num_tokens == 0:
            return torch.zeros_like(hidden)
        weights, ids = reference.select_experts(router_logits, spec, correction_bias)
        block_m = self.tuning.block_m_for(num_tokens * top_k, spec.num_experts)
        sorted_pairs, block_experts = align_to_blocks(
            ids, spec.num_experts, block_m, self.expert_range
        )
        act = self.gate_up(hidden, sorted_pairs, block_experts, block_m)
        pair_out = self.down(
            act, weights.to(spec.dtype).reshape(-1), sorted_pairs, block_experts, block_m
        )
        if top_k == 1:
            return pair_out
        summed = pair_out.view(num_tokens, top_k, spec.hidden_size).sum(1, dtype=torch.float32)
        return summed.to(spec.dtype)

    def gate_up(
        self,
        hidden: torch.Tensor,
        sorted_pairs: torch.Tensor,
        block_experts: torch.Tensor,
        block_m: int,
    ) -> torch.Tensor:
        """``[T * top_k, I]``: ``silu(gate) * up`` of each pair, in the model dtype."""
        spec, w13 = self.spec, self.w13
        inner, num_blocks = spec.intermediate_size, block_experts.numel()
        act = torch.empty(
            hidden.shape[0] * spec.top_k, inner, dtype=spec.dtype, device=hidden.device
        )
        block_n = dot_block(inner, self.tuning.block_n)
        gate_up_kernel[(num_blocks * triton.cdiv(inner, block_n),)](
            act,
            hidden,
            w13,
            sorted_pairs,
            block_experts,
            num_blocks,
            act.shape[0],
            spec.num_experts,
            spec.top_k,
            spec.hidden_size,
            inner,
            *hidden.stride(),
            *w13.stride(),
            *act.stride(),
            UPCAST=self.upcast,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=dot_block(spec.hidden_size, self.tuning.block_k),
            GROUP_M=self.tuning.group_m,
            EMULATE=self.interpret,
            **self.launch,
        )
        return act

    def down(
        self,
        act: torch.Tensor,
        weights: torch.Tensor,
        sorted_pairs: torch.Tensor,
        block_experts: torch.Tensor,
        block_m: int,
    ) -> torch.Tensor:
        """``[T * top_k, H]``: each pair's ``w2`` product times its routing weight."""
        spec, w2 = self.spec, self.w2
        hidden_size, num_blocks = spec.hidden_size, block_experts.numel()
        out = torch.empty(act.shape[0], hidden_size, dtype=spec.dtype, device=act.device)
        block_n = dot_block(hidden_size, self.tuning.block_n)
        down_kernel[(num_blocks * triton.cdiv(hidden_size, block_n),)](
            out,
            act,
            w2,
            weights,
            sorted_pairs,
            block_experts,
            num_blocks,
            act.shape[0],
            spec.num_experts,
            hidden_size,
            spec.intermediate_size,
            *out.stride(),
            *act.stride(),
            *w2.stride(),
            UPCAST=self.upcast,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=dot_block(spec.intermediate_size, self.tuning.block_k),
            GROUP_M=self.tuning.group_m,
            EMULATE=self.interpret,
            **self.launch,
        )
        return out


def make_fused_moe(spec: MoESpec, tuning: MoETuning = MoETuning()) -> FusedMoEPacker:
    """The hook's ``pack(w13, w2) -> FusedMoEFn`` for layers of ``spec``
    (``tuning.for_interpreter()`` under the interpreter)."""
    if spec.dtype not in DTYPES or spec.activation != "silu":
        raise ValueError(
            f"the Triton fused MoE takes silu experts in {', '.join(map(str, DTYPES))}, not "
            f"{spec.activation} in {spec.dtype}"
        )
    tuning = tuning.for_interpreter() if interpreting() else tuning

    def pack(w13: torch.Tensor, w2: torch.Tensor) -> FusedMoEFn:
        return TritonFusedMoE(spec, w13, w2, tuning)

    return pack
