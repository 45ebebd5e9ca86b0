"""Multi-head latent attention on the host CPU (csrc/mla_attention.cpp): one compiled call
writes the step's ``[latent, rotary key]`` rows and attends every request of the mixed batch,
prefill chunks and decodes, where the rows lie (one row per token shared by every head, each
row loaded once for all of a request's heads; softmax online in float32).

float32 and bfloat16 models; without the compiled library (or one built before this kernel),
or for another dtype, the hook gives None and the core's reference backend serves.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch

from octavo.platform.types import AttentionMetadata, MLAAttentionBackend, MLASpec

DTYPES = (torch.float32, torch.bfloat16)


def make_mla_backend(spec: MLASpec, ops: Any) -> Optional[MLAAttentionBackend]:
    """The compiled backend for ``spec`` over the loaded library's ``ops``, or None."""
    if ops is None or not hasattr(ops, "mla_attention") or spec.dtype not in DTYPES:
        return None
    _register_fakes(ops.name)
    return CpuMLABackend(spec, ops)


class CpuMLABackend(MLAAttentionBackend):
    """The compiled op behind the :class:`MLAAttentionBackend` contract."""

    name = "cpu-mla"

    def __init__(self, spec: MLASpec, ops: Any):
        super().__init__(spec)
        self._op = ops.mla_attention.default

    def forward(self, query, kv_row, kv_cache, metadata: AttentionMetadata) -> torch.Tensor:
        num_tokens = metadata.num_actual_tokens
        if num_tokens < 0:
            num_tokens = query.shape[0]
        out = query.new_empty(query.shape[0], query.shape[1], self.spec.kv_lora_rank)
        self._op(
            out,
            query if query.stride(-1) == 1 else query.contiguous(),
            kv_row if kv_row.stride(-1) == 1 else kv_row.contiguous(),
            kv_cache,
            metadata.slot_mapping,
            metadata.block_table,
            metadata.query_start_loc,
            metadata.seq_lens,
            self.spec.scale,
            num_tokens,
        )
        return out


@functools.lru_cache(maxsize=None)
def _register_fakes(namespace: str) -> None:
    """The op's fake (meta) implementation, so that torch.compile traces through it: it writes
    ``out`` and ``kv_cache`` in place and returns nothing."""

    @torch.library.register_fake(f"{namespace}::mla_attention")
    def _mla_attention(
        out, query, kv_row, kv_cache, slot_mapping, block_table, qsl, seq_lens, scale, n
    ):
        return None
