"""The cpu platform's linear layers: a GEMM over weights packed once, at load.

Three ways, chosen by ``OCTAVO_CPU_GEMM`` (default: the first this host has for the dtype):

- ``compiled``: the platform's own kernel (csrc/gemm.cpp) over weights packed into column
  panels, float32 sums over float32 rows. Its sums run in one fixed order per output, so a
  row's result does not depend on the batch around it. A float32 model's weights are packed in
  float32; a bfloat16 model's in bfloat16 (widened exactly in registers: half the bytes to
  stream), its rows widened to float32 and each product rounded back, the numbers
  ``octavo.models.layers.widen`` gives. That is the default for bfloat16 on CPUs without a
  native bfloat16 matmul (``Capabilities.widened_matmul_dtypes``); on those with one it is
  ``OCTAVO_CPU_GEMM=compiled``: on SmolLM2-135M there its ITL at one stream was 2.5x lower
  than oneDNN's, its offline throughput half (float32 FMAs against oneDNN's bfloat16 dot
  products; BENCHMARKS.md, issue 60 second part).
  For float32, on the decode steps' few rows it streams the weights x1.2-x1.8 faster than
  oneDNN does, and it keeps up with oneDNN on prefill's many rows (benchmarks/cpu_gemm.py).
- ``onednn``: ``torch.ops.mkldnn._reorder_linear_weight`` lays a weight out in oneDNN's blocked
  format once; ``_linear_pointwise`` multiplies without re-packing it every call, as
  ``F.linear`` does. For bfloat16 the results are the same bits as ``F.linear``'s (torch's
  bfloat16 matmul is oneDNN's); for float32 they differ from MKL's by summation order only. The
  default for bfloat16 on CPUs with native bfloat16, and without the compiled kernels.
- ``torch``: ``F.linear`` (no packer).
"""

from __future__ import annotations

import os
from typing import Callable, Optional

import torch

from octavo.platform import LinearPacker
from octavo_cpu.kernels import load_kernels

GEMM_ENV = "OCTAVO_CPU_GEMM"
CHOICES = ("compiled", "onednn", "torch")
BATCH_HINT = 64  # the rows oneDNN's reorder is tuned for (a hint: any row count works)


def gemm_choice() -> str:
    """``OCTAVO_CPU_GEMM``, checked: one of CHOICES, or "" (unset: the default)."""
    raw = os.environ.get(GEMM_ENV, "").strip().lower()
    if raw and raw not in CHOICES:
        raise ValueError(f"{GEMM_ENV}={raw!r}: use {', '.join(CHOICES)} (or leave it unset)")
    return raw


def linear_packer(
    dtype: torch.dtype, widened: tuple[torch.dtype, ...] = ()
) -> Optional[LinearPacker]:
    """The packer for ``dtype``'s linear layers, or None (``F.linear``). ``widened``: the dtypes
    this CPU multiplies in float32 (see ``slow_matmul_dtypes``)."""
    raw = gemm_choice()
    if raw == "torch":
        share_cores_with_openmp()  # F.linear runs on OpenMP's threads too
        return None
    compiled = compiled_packer(dtype, widened)
    if raw == "compiled":
        if compiled is None:
            raise ValueError(
                f"{GEMM_ENV}=compiled, but the compiled GEMM does not run here for {dtype} "
                f"({load_kernels().path} kernels; it needs them, and float32 or a widened dtype):"
                " unset it or pick onednn"
            )
        return compiled
    if raw == "" and compiled is not None and (dtype == torch.float32 or dtype in widened):
        return compiled
    return onednn_packer(dtype)


def describe_gemm() -> str:
    """Which GEMM the linear layers run, for ``octavo env``."""
    try:
        raw = gemm_choice()
        compiled = load_kernels().ops is not None
    except ValueError as exc:  # a bad setting: refused when an engine starts
        return f"not usable: {exc}"
    if raw:
        return f"{raw} ({GEMM_ENV})"
    if compiled:
        return "compiled (oneDNN for bfloat16 where the CPU has it natively)"
    return "oneDNN (no compiled kernels)"


def compiled_packer(
    dtype: torch.dtype, widened: tuple[torch.dtype, ...] = (), stored: torch.dtype = torch.float32
) -> Optional[LinearPacker]:
    """The compiled kernel's packer for ``dtype``, or None where it does not run (no compiled
    kernels, or a dtype other than float32 and bfloat16). ``stored`` bfloat16 keeps the packed
    weights rounded to bfloat16 (products in float32 over them: a draft head's, see
    ``octavo_cpu.draft_head``); a bfloat16 model's are stored so (exactly), and its packer is
    marked ``takes_float32``: the layers widen their rows and round the products (and biases)
    back, see ``octavo.models.layers.packed``. ``widened`` is accepted for the callers that
    pass the host's widened dtypes; bfloat16 runs the same way with or without it."""
    ops = load_kernels().ops
    if ops is None or dtype not in (torch.float32, torch.bfloat16, *widened):
        return None
    if dtype == torch.bfloat16:
        stored = torch.bfloat16
    pack_weight = (
        ops.pack_linear_weight_bf16 if stored == torch.bfloat16 else ops.pack_linear_weight
    )

    linear = ops.linear.default  # the overload itself: the packet's lookup costs ~1 us a call
    f32 = torch.float32

    def pack(weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        packed = pack_weight(weight)
        out_features, in_features = weight.shape

        def product(x: torch.Tensor) -> torch.Tensor:
            # A model's activations: one call and an allocation (a decode step makes a few
            # dozen of these, and the general path below costs ~10 us more each).
            if x.dtype is f32 and x.dim() == 2 and x.is_contiguous():
                out = torch.empty(x.shape[0], out_features, dtype=f32)
                linear(out, x, packed)
                return out
            rows = x.reshape(-1, in_features).to(f32).contiguous()
            out = torch.empty(rows.shape[0], out_features, dtype=f32)
            linear(out, rows, packed)
            return out.view(*x.shape[:-1], out_features).to(x.dtype)

        product.packed = packed  # for a caller that runs the kernel itself (decoder_stack)
        return product

    pack.takes_float32 = dtype != torch.float32
    return pack


def onednn_packer(dtype: torch.dtype) -> Optional[LinearPacker]:
    """oneDNN's packer for ``dtype``, or None where oneDNN has no native GEMM for it."""
    if not torch.backends.mkldnn.is_available():
        return None
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return None  # no native bfloat16: the layers are widened to float32 instead
    if dtype not in (torch.float32, torch.bfloat16):
        return None
    return pack_onednn


def pack_onednn(weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """``fn(x) -> x @ weight.T`` over ``weight`` reordered once for oneDNN."""
    share_cores_with_openmp()
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), BATCH_HINT)
    linear = torch.ops.mkldnn._linear_pointwise

    def product(x: torch.Tensor) -> torch.Tensor:
        return linear(x, packed, None, "none", [], "")

    return product


def share_cores_with_openmp() -> None:
    """oneDNN (and ``F.linear``) multiply on OpenMP's threads, the compiled kernels on a work pool
    of their own, whose helpers spin between jobs: a helper spinning on a core kept the GEMM's
    OpenMP thread off it (an RMSNorm then a 128-row bfloat16 GEMM on the AMX host: 150-300 us
    more than the two apart). Once such GEMMs run in this process, the pool's helpers yield
    their core while they wait (30-80 us)."""
    ops = load_kernels().ops
    if ops is not None:
        ops.set_work_pool_yield(True)
