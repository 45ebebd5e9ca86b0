"""The shared Triton fused MoE beyond the conformance suite (interpreter or GPU).

The suite (``octavo.testing.conformance.test_fused_moe``) checks the platform's layer against
the reference. Here: that the platform serves the Triton layer (not the reference loop), the
sorting of pairs into blocks of one expert, a prefill-sized step with tiles small enough to
cross every block, tile and loop boundary (skewed routing: one expert over several blocks,
one never chosen), strided operands, top-1 routing, messages for wrong shapes, and both
kernels compiled for sm_80, sm_90 and gfx942 (run as a script, this file compiles them).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import subprocess
import sys

import pytest
import torch

from octavo.ops import reference
from octavo.platform.types import MoESpec
from octavo.testing.conformance import tolerances
from octavo_triton.fused_moe import MoETuning, TritonFusedMoE, align_to_blocks

pytestmark = pytest.mark.needs_kernels

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# GPU-like tiles, small enough that a small step crosses them all.
SMALL_TILES = MoETuning(block_m=16, small_block_m=16, block_n=16, block_k=16, group_m=2)


def layer_operands(tokens, hidden, inner, experts, dtype, seed=0):
    """``x [T, H]`` a column slice of a wider tensor, ``w13``/``w2`` slices of wider stacks
    (none of them contiguous), router logits favouring expert 0 and shunning the last."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden + 5, generator=gen).to(dtype)[:, 2 : 2 + hidden]
    w13 = (torch.randn(experts, 2 * inner, hidden + 3, generator=gen) / hidden**0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inner + 4, generator=gen) / inner**0.5).to(dtype)
    logits = torch.randn(tokens, experts, generator=gen)
    logits[:, 0] += 3.0
    logits[:, -1] -= 30.0
    return x, logits.to(dtype), w13[..., :hidden], w2[..., 1 : 1 + inner]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_platform_serves_the_triton_layer(platform, device, dtype):
    """``Platform.fused_moe`` packs a :class:`TritonFusedMoE` in every model dtype; a dtype
    the kernels do not take falls back to the reference loop."""
    spec = MoESpec(4, 2, 32, 16, dtype)
    w13 = torch.zeros(4, 32, 32, dtype=dtype, device=device)
    w2 = torch.zeros(4, 32, 16, dtype=dtype, device=device)
    assert isinstance(platform.fused_moe(spec)(w13, w2), TritonFusedMoE)
    fallback = platform.fused_moe(MoESpec(4, 2, 32, 16, torch.float64))
    assert isinstance(fallback, functools.partial) and fallback.func is reference.pack_fused_moe


def test_pairs_are_sorted_into_blocks_of_one_expert():
    """Pair ``t * top_k + k`` of each expert in pair order, a run per expert padded to whole
    blocks with the id ``M``; the blocks past the last expert's are marked ``num_experts``."""
    ids = torch.tensor([[2, 0], [2, 1], [0, 2], [2, 0], [1, 2]])  # expert 3 unused
    sorted_pairs, block_experts = align_to_blocks(ids, 4, 4, torch.arange(5))
    pad = 10
    assert sorted_pairs.view(-1, 4).tolist() == [
        [1, 4, 7, pad],
        [3, 8, pad, pad],
        [0, 2, 5, 6],
        [9, pad, pad, pad],
        [pad] * 4,
    ]
    assert block_experts.tolist() == [0, 1, 2, 2, 4]


@pytest.mark.parametrize("block_m", (1, 16, 64))
def test_every_pair_lands_once_in_a_block_of_its_expert(block_m):
    """Random routings: each pair exactly once, in a block of its own expert, the blocks
    enough for any step of that many pairs (one token, or more experts than pairs)."""
    gen = torch.Generator().manual_seed(block_m)
    for tokens, experts, top_k in ((1, 8, 2), (37, 16, 4), (50, 3, 1)):
        ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
        sorted_pairs, block_experts = align_to_blocks(
            ids, experts, block_m, torch.arange(experts + 1)
        )
        num_pairs = ids.numel()
        real = sorted_pairs < num_pairs
        assert sorted(sorted_pairs[real].tolist()) == list(range(num_pairs))
        owner = block_experts.repeat_interleave(block_m)
        assert torch.equal(owner[real], ids.reshape(-1)[sorted_pairs[real]])
        assert not real[owner == experts].any()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_m", (16, 32))
def test_a_prefill_step_across_every_tile(device, dtype, block_m):
    """60 tokens, top-2 of 4 experts (expert 0 in almost every token's choice: several
    blocks of it; expert 3 in none), widths 72 and 40 over 16-wide tiles and steps: the
    reference within the suite's tolerance, the inputs untouched, the same numbers twice."""
    tokens, hidden, inner, experts = 60, 72, 40, 4
    spec = MoESpec(experts, 2, hidden, inner, dtype)
    x, logits, w13, w2 = layer_operands(tokens, hidden, inner, experts, dtype)
    expected = reference.fused_moe(x, logits, w13, w2, spec)
    tuning = dataclasses.replace(SMALL_TILES, block_m=block_m, small_block_m=block_m)
    on = [t.to(device) for t in (x, logits, w13, w2)]
    layer = TritonFusedMoE(spec, on[2], on[3], tuning)
    out = layer(on[0], on[1])
    assert out.dtype == dtype and out.shape == x.shape
    tolerances.assert_close(out, expected, tolerances.FUSED_MOE[dtype], "prefill step")
    for before, after in zip((x, logits, w13, w2), on):
        assert torch.equal(after.cpu(), before)
    assert torch.equal(layer(on[0], on[1]).cpu(), out.cpu())


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_top_1_routing_and_the_grouped_choice(device, dtype):
    """Top-1 routing (no per-token sum) with and without renormalisation, and the sigmoid
    grouped choice with a correction bias and a scaling factor, on a decode-sized step."""
    x, logits, w13, w2 = layer_operands(5, 48, 24, 8, dtype, seed=3)
    bias = torch.randn(8, generator=torch.Generator().manual_seed(4)) * 0.1
    specs = (
        (MoESpec(8, 1, 48, 24, dtype, renormalize=False), None),
        (MoESpec(8, 1, 48, 24, dtype), None),
        (MoESpec(8, 2, 48, 24, dtype, "sigmoid", True, 4, 2, 2.5), bias),
    )
    for spec, correction in specs:
        expected = reference.fused_moe(x, logits, w13, w2, spec, correction)
        layer = TritonFusedMoE(spec, w13.to(device), w2.to(device), SMALL_TILES)
        out = layer(
            x.to(device), logits.to(device), None if correction is None else bias.to(device)
        )
        tolerances.assert_close(out, expected, tolerances.FUSED_MOE[dtype], str(spec))


def test_wrong_shapes_say_what_to_pass(device):
    spec = MoESpec(4, 2, 32, 16, torch.float16)
    w13 = torch.zeros(4, 32, 32, dtype=torch.float16, device=device)
    w2 = torch.zeros(4, 32, 16, dtype=torch.float16, device=device)
    with pytest.raises(ValueError, match=r"w13 \[4, 32, 32\] \(gate rows, then up rows\)"):
        TritonFusedMoE(spec, w13[:, :16], w2, SMALL_TILES)
    with pytest.raises(ValueError, match="in the model's dtype torch.float16"):
        TritonFusedMoE(spec, w13, w2.float(), SMALL_TILES)
    layer = TritonFusedMoE(spec, w13, w2, SMALL_TILES)
    with pytest.raises(ValueError, match=r"pass \[tokens, 32\] in the model's dtype"):
        layer(torch.zeros(3, 32, device=device), torch.zeros(3, 4, device=device))
    assert layer(w13[0, :0], torch.zeros(0, 4, device=device)).shape == (0, 32)


# --- compiled for real GPUs ------------------------------------------------------------------


def moe_builds(tuning: MoETuning):
    """Both kernels in each dtype with ``tuning``'s tiles and both blocks of pairs."""
    from octavo_triton import compile_check as cc
    from octavo_triton import fused_moe_kernels as kernels

    blocks = {"sorted_pairs_ptr": "i64", "block_experts_ptr": "i64"}
    options = {"num_warps": tuning.num_warps, "num_stages": tuning.num_stages}
    builds = []
    for dtype in cc.DTYPES:
        t = cc.TRITON_TYPES[dtype]
        for block_m in (tuning.small_block_m, tuning.block_m):
            tiles = dict(
                UPCAST=False,
                BLOCK_M=block_m,
                BLOCK_N=tuning.block_n,
                BLOCK_K=tuning.block_k,
                GROUP_M=tuning.group_m,
                EMULATE=False,
            )
            gate_up = {"act_ptr": t, "x_ptr": t, "w13_ptr": t, **blocks}
            down = {"out_ptr": t, "act_ptr": t, "w2_ptr": t, "weights_ptr": t, **blocks}
            builds += [
                cc.KernelBuild(
                    f"moe_gate_up[{t},m{block_m}]", kernels.gate_up_kernel, gate_up, tiles, options
                ),
                cc.KernelBuild(
                    f"moe_down[{t},m{block_m}]", kernels.down_kernel, down, tiles, options
                ),
            ]
    return builds


TARGETS = (("cuda", 80, 32), ("cuda", 90, 32), ("hip", "gfx942", 64))


def compile_for_targets() -> None:
    """Compile :func:`moe_builds` for :data:`TARGETS` (no GPU needed), a line per kernel:
    target, kernel, whether its PTX multiplies in TF32, its stages."""
    import triton
    from triton.backends.compiler import GPUTarget

    for target in TARGETS:
        for build in moe_builds(MoETuning()):
            compiled = triton.compile(
                build.source(), target=GPUTarget(*target), options=build.options
            )
            stages = [s for s in ("ptx", "cubin", "amdgcn", "hsaco") if s in compiled.asm]
            tf32 = "tf32" in compiled.asm.get("ptx", "")
            print(f"{target[0]}:{target[1]}", build.name, f"tf32={tf32}", "+".join(stages))


@pytest.mark.slow
def test_moe_kernels_compile_for_sm80_sm90_and_gfx942():
    """No TF32 for float32 operands, dot shapes the matrix units take and tiles that fit in
    shared memory, checked by the real pipeline (in a subprocess: kernels are not
    JITFunctions under TRITON_INTERPRET=1)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-4000:]
    lines = result.stdout.splitlines()
    assert len(lines) == len(TARGETS) * 12, result.stdout
    assert all(line.endswith(("ptx+cubin", "amdgcn+hsaco")) for line in lines), result.stdout
    assert not [line for line in lines if "tf32=True" in line], result.stdout


if __name__ == "__main__":
    compile_for_targets()
