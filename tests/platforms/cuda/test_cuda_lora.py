"""The shared Triton LoRA kernels beyond the conformance suite (interpreter or GPU).

The suite (``octavo.testing.conformance.test_lora``) checks what each call picks against the
reference. Here: both launch shapes (by token and by segment) on a prefill-sized step with
tiles small enough to cross every program and loop boundary, strided operands, 16-bit outputs
rounded once (within an ulp of the reference), the per-call choice of shape, and every kernel
compiled for sm_80, sm_90 and gfx942 (run as a script, this file compiles them).
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from octavo.lora.mapping import build_lora_mapping
from octavo.ops import reference
from octavo_triton.lora import LoRATuning, TritonLoRAKernels

pytestmark = pytest.mark.needs_kernels

# GPU-like tiles, smaller than the default ones so a small step crosses them all: several
# tiles of one segment, rank blocks and rank loops, input and output blocks.
SMALL_TILES = LoRATuning(
    token_block_r=16,
    token_block_k=32,
    token_block_n=64,
    segment_block_m=16,
    segment_block_n=32,
    segment_block_r=16,
    segment_block_k=32,
)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SHAPES = ("token", "segment")
# tokens, K, rank, N, slots: a prefill chunk per adapter, with rank blocks and a rank loop.
STEP = (90, 200, 24, 100, 3)


def prefill_slots(num_tokens: int) -> np.ndarray:
    """Requests' tokens in runs of 37, 9, 30 and 14 (a base-model run among them), with a
    slot repeated by a later run, so segments are long, uneven and not contiguous."""
    runs = ((1, 37), (-1, 9), (0, 30), (1, 14))
    slots = np.concatenate([np.full(n, slot) for slot, n in runs])
    assert len(slots) == num_tokens
    return slots


def operands(dtype: torch.dtype, seed: int = 0):
    """``x``, ``a_stacked``, ``b_stacked`` of :data:`STEP` as strided views: ``x`` a column
    slice, the stacks a rank slice of wider (rank-padded) stacks."""
    num_tokens, k, rank, n, slots = STEP
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, k + 7, generator=gen).to(dtype)[:, 3 : 3 + k]
    a_wide = (torch.randn(slots, rank + 8, k, generator=gen) / k**0.5).to(dtype)
    b_wide = (torch.randn(slots, n, rank + 8, generator=gen) / rank**0.5).to(dtype)
    return x, a_wide[:, :rank], b_wide[:, :, :rank]


def exact_expand(y, buffer, b_stacked, slots: np.ndarray, offset: int) -> torch.Tensor:
    """``y`` plus each adapter token's ``buffer[t] @ B[slot].T`` in float64: the exact sum."""
    exact = y.double()
    n = b_stacked.shape[1]
    for t in np.flatnonzero(slots >= 0):
        exact[t, offset : offset + n] += b_stacked[slots[t]].double() @ buffer[t].double()
    return exact


def assert_rounded_once(actual: torch.Tensor, exact: torch.Tensor) -> None:
    """16-bit ``actual`` within half an ulp of the exact sum (one rounding) plus float32's
    summation noise; float32 within the summation order's error."""
    actual = actual.cpu()
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual.double(), exact, atol=1e-5, rtol=1e-5)
        return
    magnitude = actual.abs()
    ulp = torch.nextafter(magnitude, torch.full_like(magnitude, float("inf"))) - magnitude
    excess = (actual.double() - exact).abs() - (ulp.double() / 2 + 1e-6)
    assert excess.max() <= 0, f"{actual.dtype}: {excess.max().item():.3g} beyond one rounding"


def run(kernels: TritonLoRAKernels, shape: str, product: str, *args):
    """``kernels``' ``product`` ("shrink", "expand") in launch ``shape`` ("token", "segment")."""
    return getattr(kernels, f"{product}_by_{shape}")(*args)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES)
def test_shrink_on_a_prefill_step(device, dtype, shape):
    """Both shapes, strided ``x`` and stacks: the reference within summation order, zeros for
    the base model's rows."""
    slots = prefill_slots(STEP[0])
    x, a_stacked, _ = operands(dtype)
    expected = reference.lora_shrink(x, a_stacked, build_lora_mapping(slots, "cpu"))
    kernels = TritonLoRAKernels(dtype, SMALL_TILES)
    mapping = build_lora_mapping(slots, device)
    x_dev, a_dev = x.clone().to(device), a_stacked.clone().to(device)
    out = run(kernels, shape, "shrink", x_dev, a_dev, mapping).cpu()
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-5)
    assert not out[slots < 0].any()
    assert torch.equal(x_dev.cpu(), x) and torch.equal(a_dev.cpu(), a_stacked)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES)
def test_expand_on_a_prefill_step(device, dtype, shape):
    """Both shapes, from a column slice of a wider float32 buffer into the middle columns of
    ``y``: 16-bit results within an ulp of the reference (one rounding), every element outside
    the adapters' rows and the columns bit-identical."""
    num_tokens, _, rank, n, _ = STEP
    slots = prefill_slots(num_tokens)
    _, _, b_stacked = operands(dtype)
    gen = torch.Generator().manual_seed(1)
    wide = torch.randn(num_tokens, 3 * rank, generator=gen)
    offset = 11
    y = torch.randn(num_tokens, offset + n + 6, generator=gen).to(dtype)
    exact = exact_expand(y, wide[:, rank : 2 * rank], b_stacked, slots, offset)
    kernels = TritonLoRAKernels(dtype, SMALL_TILES)
    y_dev, wide_dev = y.clone().to(device), wide.clone().to(device)
    buffer = wide_dev[:, rank : 2 * rank]
    mapping = build_lora_mapping(slots, device)
    run(kernels, shape, "expand", y_dev, buffer, b_stacked.to(device), mapping, offset)
    assert_rounded_once(y_dev.cpu(), exact)
    touched = torch.zeros_like(y, dtype=torch.bool)
    touched[torch.from_numpy(slots >= 0), offset : offset + n] = True
    assert torch.equal(y_dev.cpu()[~touched], y[~touched])
    assert torch.equal(wide_dev.cpu(), wide)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_the_two_shapes_agree_on_a_decode_batch(device, dtype):
    """Decode-like slots (each token its own request, slots interleaved, base-model rows
    between): the shapes give the same shrink (float32 summation order only), and each expand
    is the exact sum rounded once."""
    num_tokens, n = 40, STEP[3]
    slots = np.random.default_rng(3).integers(-1, 3, num_tokens)
    x, a_stacked, b_stacked = operands(dtype, seed=2)
    x, a_stacked = x[:num_tokens].to(device), a_stacked.to(device)
    kernels = TritonLoRAKernels(dtype, SMALL_TILES)
    mapping = build_lora_mapping(slots, device)
    shrunk = {s: run(kernels, s, "shrink", x, a_stacked, mapping).cpu() for s in SHAPES}
    torch.testing.assert_close(shrunk["token"], shrunk["segment"], atol=1e-5, rtol=1e-5)
    y = torch.randn(num_tokens, n, generator=torch.Generator().manual_seed(4)).to(dtype)
    exact = exact_expand(y, shrunk["token"], b_stacked, slots, 0)
    for shape in SHAPES:
        y_dev = y.clone().to(device)
        buffer = shrunk["token"].to(device)
        run(kernels, shape, "expand", y_dev, buffer, b_stacked.to(device), mapping, 0)
        assert_rounded_once(y_dev, exact)


def test_each_call_picks_its_shape():
    """By segment once the longest segment fills ``segment_min_length`` tokens (a prefill
    chunk), by token for decode steps; the choice reads only the host's mapping."""
    kernels = TritonLoRAKernels(torch.float16, LoRATuning(segment_min_length=16))
    decode = build_lora_mapping(np.array([0, 1, -1, 2, 0, 1]), "cpu")
    prefill = build_lora_mapping(np.array([-1] * 3 + [2] * 16 + [0]), "cpu")
    assert not kernels.by_segment(decode)
    assert kernels.by_segment(prefill)


def test_wrong_shapes_say_what_to_pass(device):
    kernels = TritonLoRAKernels(torch.float32, SMALL_TILES)
    mapping = build_lora_mapping(np.array([0, -1]), device)
    x = torch.zeros(2, 8, device=device)
    with pytest.raises(ValueError, match=r"a_stacked as \[slots, rank, K\]"):
        kernels.shrink(x, torch.zeros(1, 4, 9, device=device), mapping)
    buffer = torch.zeros(2, 4, device=device)
    with pytest.raises(ValueError, match="too narrow"):
        kernels.expand(x, buffer, torch.zeros(1, 6, 4, device=device), mapping, 3)
    with pytest.raises(ValueError, match="not torch.float8_e4m3fn"):
        TritonLoRAKernels(torch.float8_e4m3fn)


# --- compiled for real GPUs ------------------------------------------------------------------


def lora_builds(tuning: LoRATuning):
    """Each LoRA kernel in each dtype with ``tuning``'s blocks (rank 16; the expand by segment
    with a whole rank-64 block)."""
    from octavo_triton import compile_check as cc
    from octavo_triton import lora_kernels as lora

    builds = []
    segments = {"sorted_tokens_ptr": "i64", "segment_slots_ptr": "i64", "segment_starts_ptr": "i64"}
    options = {"num_warps": tuning.num_warps, "num_stages": tuning.num_stages}
    for dtype in cc.DTYPES:
        t = cc.TRITON_TYPES[dtype]
        shrink = {"out_ptr": "fp32", "x_ptr": t, "a_ptr": t}
        expand = {"y_ptr": t, "buffer_ptr": "fp32", "b_ptr": t}
        m, n, k = tuning.segment_block_m, tuning.segment_block_n, tuning.segment_block_k
        builds += [
            cc.KernelBuild(
                f"lora_token_shrink[{t}]",
                lora.token_shrink_kernel,
                {**shrink, "token_slots_ptr": "i64"},
                dict(BLOCK_R=16, BLOCK_K=tuning.token_block_k),
                options,
            ),
            cc.KernelBuild(
                f"lora_token_expand[{t}]",
                lora.token_expand_kernel,
                {**expand, "token_slots_ptr": "i64"},
                dict(BLOCK_N=tuning.token_block_n, BLOCK_R=16, EMULATE=False),
                options,
            ),
            cc.KernelBuild(
                f"lora_segment_shrink[{t}]",
                lora.segment_shrink_kernel,
                {**shrink, **segments},
                dict(UPCAST=False, BLOCK_M=m, BLOCK_R=16, BLOCK_K=k),
                options,
            ),
            cc.KernelBuild(
                f"lora_segment_expand[{t}]",
                lora.segment_expand_kernel,
                {**expand, **segments},
                dict(BLOCK_M=m, BLOCK_N=n, BLOCK_R=64, EMULATE=False),
                options,
            ),
        ]
    return builds


TARGETS = (("cuda", 80, 32), ("cuda", 90, 32), ("hip", "gfx942", 64))


def compile_for_targets() -> None:
    """Compile :func:`lora_builds` for :data:`TARGETS` (no GPU needed), a line per kernel:
    target, kernel, whether its PTX multiplies in TF32, its stages."""
    import triton
    from triton.backends.compiler import GPUTarget

    for target in TARGETS:
        for build in lora_builds(LoRATuning()):
            compiled = triton.compile(
                build.source(), target=GPUTarget(*target), options=build.options
            )
            stages = [s for s in ("ptx", "cubin", "amdgcn", "hsaco") if s in compiled.asm]
            tf32 = "tf32" in compiled.asm.get("ptx", "")
            print(f"{target[0]}:{target[1]}", build.name, f"tf32={tf32}", "+".join(stages))


@pytest.mark.slow
def test_lora_kernels_compile_for_sm80_sm90_and_gfx942():
    """No TF32 for float32 operands and dot shapes the matrix units take, checked by the real
    pipeline (in a subprocess: kernels are not JITFunctions under TRITON_INTERPRET=1)."""
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
