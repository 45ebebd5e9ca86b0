"""Fake (meta) implementations of the compiled cpu ops, so that torch.compile can trace a forward
through them instead of breaking the graph at each call (the groundwork of
``--no-enforce-eager``; eager runs never call these). Every op writes its outputs in place and
returns nothing (a result aliasing an input cannot be functionalised), so each fake only has to
accept its arguments."""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=None)
def register_fakes(namespace: str) -> None:
    """Register the fakes of one loaded library's ops (``octavo_cpu_avx512``, ...), once."""

    @torch.library.register_fake(f"{namespace}::paged_attention")
    def _paged_attention(out, query, key, value, kv_cache, slot_mapping, block_table, *rest):
        return None

    @torch.library.register_fake(f"{namespace}::argmax_rows")
    def _argmax_rows(out, logits):
        return None

    @torch.library.register_fake(f"{namespace}::rms_norm")
    def _rms_norm(out, x, weight, eps):
        return None

    @torch.library.register_fake(f"{namespace}::fused_add_rms_norm")
    def _fused_add_rms_norm(out, summed, x, residual, weight, eps):
        return None

    @torch.library.register_fake(f"{namespace}::silu_and_mul")
    def _silu_and_mul(out, gate, up):
        return None

    @torch.library.register_fake(f"{namespace}::linear")
    def _linear(out, x, packed):
        return None

    @torch.library.register_fake(f"{namespace}::quantized_linear")
    def _quantized_linear(out, x, packed, quant_type, in_features):
        return None

    @torch.library.register_fake(f"{namespace}::rotary_embedding")
    def _rotary_embedding(query, key, cos, sin, head_dim):
        return None  # query and key are rotated in place
