"""Quantized weights as GGUF files and ``--quantization int8`` hold them: raw rows
(``uint8 [N, row_bytes]``, see ``octavo.quantization.quant_types``) of seeded random weights.

GGUF's block types the ``gguf`` package can quantize are quantized from normal draws; ``Q4_K``
(which it only dequantizes) is drawn as valid random blocks: small positive scales, random
6-bit sub-block scales and minima, random nibbles.
"""

from __future__ import annotations

import numpy as np
import torch

QUANT_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "int8")
SHAPES = ((1, 256, 1), (3, 256, 33), (8, 512, 130), (17, 768, 64))
"""``(M, K, N)``: one token against one row, then ragged rows and columns; K a multiple of 256
(Q4_K's super-block)."""
RELATIVE_BUDGET = 2e-2
"""``|actual - expected| / |expected|`` over the whole output (Frobenius norms). A kernel may
round each block of 32 activations to int8 (llama.cpp's way): for normal draws that moves the
output by ~0.6% of its norm. A wrong block, scale or nibble order moves it by O(1)."""


def random_rows(quant_type: str, rows: int, in_features: int, seed: int) -> torch.Tensor:
    """``uint8 [rows, row_bytes]``: a seeded random weight in ``quant_type``'s rows."""
    rng = np.random.default_rng(seed)
    if quant_type == "int8":
        from octavo.quantization.quantized_linear import int8_rows

        return int8_rows(torch.from_numpy(rng.standard_normal((rows, in_features))))
    if quant_type == "Q4_K":
        return _random_q4_k(rng, rows, in_features)
    import gguf
    from gguf.quants import quantize

    weight = rng.standard_normal((rows, in_features)).astype(np.float32)
    return torch.from_numpy(quantize(weight, gguf.GGMLQuantizationType[quant_type]))


def _random_q4_k(rng, rows: int, in_features: int) -> torch.Tensor:
    blocks = rows * in_features // 256
    raw = rng.integers(0, 256, size=(blocks, 144), dtype=np.uint8)
    scales = rng.uniform(0.002, 0.02, size=(blocks, 2)).astype(np.float16)  # d, dmin
    raw[:, :4] = scales.view(np.uint8).reshape(blocks, 4)
    return torch.from_numpy(raw.reshape(rows, in_features // 256 * 144))
