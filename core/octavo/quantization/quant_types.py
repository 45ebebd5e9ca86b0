"""The quantized row formats a linear weight can be kept in, and their sizes.

A quantized weight ``[N, K]`` is held as raw bytes ``uint8 [N, row_bytes]``: each output row
is ``K`` values quantized on their own, so rows can be sliced, permuted and sharded by output
row without touching the bytes.

- GGUF's block types (``Q8_0``, ``Q4_0``, ``Q4_1``, ``Q4_K``, ...): a row is ``K / block``
  blocks laid out as llama.cpp writes them; their sizes come from the ``gguf`` package.
- ``int8`` (``--quantization int8``): symmetric per-output-channel int8, octavo's own row
  format: ``K`` int8 values, then the row's float32 scale (4 bytes, little-endian),
  ``W[n, k] = int8[k] * scale``.
"""

from __future__ import annotations

INT8 = "int8"
"""Symmetric per-output-channel int8 rows (``K`` int8 values, then a float32 scale)."""


def gguf_quant_type(name: str):
    """The ``gguf.GGMLQuantizationType`` called ``name`` (a ValueError naming the known ones)."""
    import gguf

    try:
        return gguf.GGMLQuantizationType[name]
    except KeyError:
        known = ", ".join(t.name for t in gguf.GGMLQuantizationType)
        raise ValueError(f"unknown quantization type {name!r}; GGUF's types: {known}") from None


def block_size(quant_type: str) -> int:
    """How many consecutive values of a row one block quantizes (``int8``: 1)."""
    if quant_type == INT8:
        return 1
    import gguf

    return gguf.GGML_QUANT_SIZES[gguf_quant_type(quant_type)][0]


def row_bytes(quant_type: str, in_features: int) -> int:
    """The bytes of one quantized row of ``in_features`` values; a ValueError when the row does
    not split into whole blocks."""
    if quant_type == INT8:
        return in_features + 4
    import gguf

    block, type_size = gguf.GGML_QUANT_SIZES[gguf_quant_type(quant_type)]
    if in_features % block:
        raise ValueError(
            f"{quant_type} quantizes rows in blocks of {block} values; a row of {in_features} "
            "does not split into whole blocks"
        )
    return in_features // block * type_size
