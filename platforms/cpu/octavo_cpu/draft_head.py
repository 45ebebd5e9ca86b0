"""An EAGLE-family draft head's forward in two compiled calls (``octavo_draft_head``).

The head's modules make a pass of a few tokens from a dozen torch calls before its layer (the
target's embedding lookup, a P-EAGLE head's two ``where``s over its masked slots, the
concatenation, ``fc``, two rotary-table lookups), each costing more than its arithmetic on a
batch-1 step: ~110 us of a ~370 us head pass of the demo model, against ~25 us of kernels.
``draft_head_inputs`` (csrc/draft_head.cpp) makes the same pairs, ``fc`` and tables in one call,
and the head's decoder stack (``octavo_cpu.decoder_stack``) runs the layer and the norm in
another: bit for bit the modules' numbers (tests/platforms check it).

It applies where the head's layer runs as a decoder stack, ``fc`` is packed for the compiled
GEMM, everything is float32 on one tensor-parallel rank, and the head reads its inputs as the
EAGLE head does (not an MTP layer, which norms them first).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from octavo.models.layers.packed import PackedMatmul
from octavo.spec_decode.eagle_head import EagleHead
from octavo_cpu.decoder_stack import DecoderStack

logger = logging.getLogger(__name__)


class DraftHeadPass:
    """``fn(input_ids, hidden_states, positions, attn_metadata, masked=None) -> hidden``."""

    def __init__(self, head: Any, fc_packed: torch.Tensor, ops: Any):
        self._op = ops.draft_head_inputs.default
        self._run_layers = head.run_layers  # its decoder stack
        self._embedding = head.embed_tokens.weight.detach()
        self._mask_embedding = _parameter(head, "mask_embedding")
        self._mask_hidden = _parameter(head, "mask_hidden")
        self._fc = fc_packed
        self._fc_out = head.fc.weight.shape[0]
        self._cos, self._sin = head.rotary_emb.cos_cache, head.rotary_emb.sin_cache

    def __call__(self, input_ids, hidden_states, positions, metadata, masked=None):
        x, cos, sin = self._op(
            input_ids,
            hidden_states.contiguous(),
            masked,
            self._embedding,
            self._mask_embedding,
            self._mask_hidden,
            self._fc,
            self._fc_out,
            positions,
            self._cos,
            self._sin,
        )
        return self._run_layers(x, (cos, sin), metadata)


def make_draft_head(head: Any, ops: Any) -> Optional[DraftHeadPass]:
    """The one-call forward of ``head``, or None where it does not apply (the reason is logged
    at debug level)."""
    why = _unfit(head, ops)
    if why is not None:
        logger.debug("the draft head runs as modules: %s", why)
        return None
    return DraftHeadPass(
        head, head.fc.quant_method.product_for(0, head.fc.weight.shape[0]).packed, ops
    )


def _unfit(head: Any, ops: Any) -> Optional[str]:
    if ops is None or not hasattr(ops, "draft_head_inputs"):
        return "no compiled draft_head_inputs kernel"
    if not isinstance(head, EagleHead):
        return f"{type(head).__name__} is not an EAGLE-family head"
    if type(head).inputs is not EagleHead.inputs or type(head).predict is not EagleHead.predict:
        return f"{type(head).__name__} reads or combines its inputs its own way"
    if not isinstance(head.decoder_stack, DecoderStack):
        return "its layer does not run as a compiled decoder stack"
    embedding = head.embed_tokens
    if getattr(embedding, "tp", None) is None or embedding.tp.size != 1:
        return "a vocabulary split across tensor-parallel ranks"
    fc = head.fc
    method = getattr(fc, "quant_method", None)
    if fc.bias is not None or not isinstance(method, PackedMatmul) or method.widened:
        return "fc is not packed for the compiled GEMM"
    product = method.product_for(0, fc.weight.shape[0])
    if getattr(product, "packed", None) is None:
        return "fc is packed by another GEMM"
    tensors = [embedding.weight, head.rotary_emb.cos_cache, head.rotary_emb.sin_cache]
    tensors += [
        t for t in (_parameter(head, n) for n in ("mask_embedding", "mask_hidden")) if t is not None
    ]
    if any(t.dtype != torch.float32 for t in tensors) or head.dtype != torch.float32:
        return "the head computes in float32"
    return None


def _parameter(head: Any, name: str) -> Optional[torch.Tensor]:
    tensor = getattr(head, name, None)
    return None if tensor is None else tensor.detach()
