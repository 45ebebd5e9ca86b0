"""The cpu platform's weight-only quantized linear layers (csrc/quantized_gemm.cpp).

``quantized_packer(quant_type)`` answers ``octavo_quantized_linear_packer``: GGUF's Q8_0, Q4_0,
Q4_1 and Q4_K and ``--quantization int8``, where the compiled kernels are loaded (without them
the weights are dequantized at load). Packing interleaves the rows in panels of 16, the same
bytes in the order the kernel reads them (csrc/quantized_gemm.cpp's header); Q4_K's
super-blocks of 256 are repacked as Q4_1 blocks of 32 (``d * sc`` and ``-dmin * m`` of each
sub-block in float16: 5 bits a weight instead of 4.5, the same values to float16's precision).
"""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np
import torch

from octavo_cpu.kernels import load_kernels

KERNEL_TYPES = {"Q8_0": 0, "Q4_0": 1, "int8": 2, "Q4_1": 3, "Q4_K": 3}
"""The row formats with a kernel, and the kernel's type code (Q4_K runs as Q4_1)."""
BLOCK = 32
PANEL = 16
"""Output rows interleaved in a panel."""


def quantized_packer(quant_type: str) -> Optional[Callable]:
    """``pack(raw uint8 [N, row_bytes], in_features) -> fn(x [..., K]) -> [..., N]`` in x's
    dtype, or None: no compiled kernels here, or none for ``quant_type``."""
    ops = load_kernels().ops
    if ops is None or quant_type not in KERNEL_TYPES or not hasattr(ops, "quantized_linear"):
        return None
    code = KERNEL_TYPES[quant_type]
    linear = ops.quantized_linear.default
    f32 = torch.float32

    def pack(raw: torch.Tensor, in_features: int) -> Callable[[torch.Tensor], torch.Tensor]:
        packed = pack_rows(raw.cpu().numpy(), quant_type, in_features)
        out_features = packed.shape[0]

        def product(x: torch.Tensor) -> torch.Tensor:
            if x.dtype is f32 and x.dim() == 2 and x.is_contiguous():
                out = torch.empty(x.shape[0], out_features, dtype=f32)
                linear(out, x, packed, code, in_features)
                return out
            rows = x.reshape(-1, in_features).to(f32).contiguous()
            out = torch.empty(rows.shape[0], out_features, dtype=f32)
            linear(out, rows, packed, code, in_features)
            return out.view(*x.shape[:-1], out_features).to(x.dtype)

        product.packed = packed
        return product

    return pack


def pack_rows(raw: np.ndarray, quant_type: str, in_features: int) -> torch.Tensor:
    """The kernel's layout of GGUF (or ``int8``) rows ``raw [N, row_bytes]``: the same shape and
    bytes, each row cut into slabs (``_slabs``) and every 16 rows' slabs interleaved."""
    if quant_type == "Q4_K":
        return pack_rows(q4_k_as_q4_1(raw, in_features), "Q4_1", in_features)
    slabs, tail = _slabs(np.ascontiguousarray(raw), quant_type, in_features)
    full = raw.shape[0] // PANEL * PANEL  # rows in full panels; the rest make the last one
    parts = [_interleaved(slabs[:full], tail, 0, full, PANEL)] if full else []
    if full < raw.shape[0]:
        parts.append(_interleaved(slabs[full:], tail, full, raw.shape[0], raw.shape[0] - full))
    packed = np.concatenate(parts, axis=None).reshape(raw.shape)
    return torch.from_numpy(np.ascontiguousarray(packed))


def _interleaved(slabs: np.ndarray, tail, start: int, stop: int, panel: int) -> np.ndarray:
    """Rows ``start:stop`` (``slabs`` of them) as panels of ``panel`` rows: each panel's slabs
    row-interleaved, then its rows' ``tail`` bytes."""
    panels = (stop - start) // panel
    body = slabs.reshape(panels, panel, -1, 2).transpose(0, 2, 1, 3).reshape(panels, -1)
    if tail is None:
        return body
    return np.concatenate([body, tail[start:stop].reshape(panels, -1)], axis=1)


def _slabs(raw: np.ndarray, quant_type: str, in_features: int):
    """Each row of ``raw`` as ``[rows, slabs, 2]`` bytes in the kernel's order, and what follows
    them in a panel (``int8``'s float32 row scales, ``[rows, 4]``; else None)."""
    rows = raw.shape[0]
    if quant_type == "int8":
        return raw[:, :in_features].reshape(rows, -1, 2), raw[:, in_features:]
    nb = in_features // BLOCK
    header, quant_bytes = {"Q8_0": (2, 32), "Q4_0": (2, 16), "Q4_1": (4, 16)}[quant_type]
    blocks = raw.reshape(rows, nb, header + quant_bytes)
    quants = blocks[:, :, header:]
    if quant_type != "Q8_0":
        # GGUF's byte j holds values j and j + 16; slab s's byte h holds 4s + h and 4s + 2 + h.
        values = np.concatenate([quants & 0x0F, quants >> 4], axis=2).reshape(rows, nb, 8, 2, 2)
        quants = values[:, :, :, 0, :] | (values[:, :, :, 1, :] << 4)
    quants = quants.reshape(rows, nb, -1, 2)
    scales = blocks[:, :, :header].reshape(rows, nb, header // 2, 2)  # d (then m)
    return np.concatenate([quants, scales], axis=2).reshape(rows, -1, 2), None


def q4_k_as_q4_1(raw: np.ndarray, in_features: int) -> np.ndarray:
    """Q4_K rows (super-blocks of 256: d, dmin, 12 bytes of 6-bit sub-block scales and minima,
    128 bytes of nibbles) as Q4_1 rows (blocks of 32: d, m, 16 bytes), the same values."""
    rows = raw.shape[0]
    blocks = raw.reshape(-1, 144)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, mn = _scales_and_mins(blocks[:, 4:16])  # [B, 8] each
    qs = blocks[:, 16:].reshape(-1, 4, 32)  # chunk i: sub-blocks 2i (low), 2i + 1 (high)
    nibbles = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 8, 32)
    packed = (nibbles[:, :, :16] | (nibbles[:, :, 16:] << 4)).astype(np.uint8)
    scale = (d * sc).astype(np.float16).view(np.uint8).reshape(-1, 8, 2)
    minimum = (-dmin * mn).astype(np.float16).view(np.uint8).reshape(-1, 8, 2)
    out = np.concatenate([scale, minimum, packed], axis=2)  # [B, 8, 20]
    return out.reshape(rows, in_features // BLOCK * 20)


def _scales_and_mins(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's 6-bit packing of 8 scales and 8 minima into 12 bytes, unpacked as floats."""
    s = scales.astype(np.uint8)
    sc = np.empty((s.shape[0], 8), dtype=np.float32)
    mn = np.empty((s.shape[0], 8), dtype=np.float32)
    sc[:, :4] = s[:, 0:4] & 63
    mn[:, :4] = s[:, 4:8] & 63
    sc[:, 4:] = (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)
    mn[:, 4:] = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return sc, mn
