"""An EAGLE-family draft head's forward in two compiled calls (``octavo_draft_head``); its
logits, its greedy drafts and a Gumiho head's parallel MLP heads in one call each; and a greedy
step's whole drafting, the pass over the verified positions and the drafts (a serial head's
steps, P-EAGLE's masked slots, Gumiho's MLP heads), in one ``greedy_head_drafts`` call.

The head's modules make a pass of a few tokens from a dozen torch calls before its layer (the
target's embedding lookup, a P-EAGLE head's two ``where``s over its masked slots, the
concatenation, ``fc``, two rotary-table lookups), each costing more than its arithmetic on a
batch-1 step: ~110 us of a ~370 us head pass of the demo model, against ~25 us of kernels.
``draft_head_inputs`` (csrc/draft_head.cpp) makes the same pairs, ``fc`` and tables in one call,
and the head's decoder stack (``octavo_cpu.decoder_stack``) runs its layers (one, or a few)
and the norm in another. A Gumiho head's MLP heads (six module calls each) run in one
``draft_mlp_heads`` call, greedy drafts (the LM-head product and the argmax) in one
``greedy_tokens`` call, and with ``greedy_head_drafts`` the attention metadata of the pass and
of each serial step are built in C++ too (batch 1, K = 4: EAGLE x1.25 faster than a call per
kernel, BENCHMARKS.md).
Bit for bit the modules' numbers (tests/platforms check it).

Unless ``OCTAVO_CPU_DRAFT_WEIGHTS=float32``, the head's linears are packed again over bfloat16
weights (multiplied in float32, csrc/gemm.cpp), its modules' and its one call's alike, and its
drafts are scored by a bfloat16 copy of the target's LM head (half the LM head's float32 size
more memory): drafts never reach the output, and a batch-1 head pass streams half the bytes
(the demo model's heads accept within 0.2% of their float32 figures; BENCHMARKS.md).

It applies where the head's layers run as a decoder stack, every linear is packed for the
compiled GEMM, everything is float32 on one tensor-parallel rank, and the head reads its inputs
and scores its drafts as the EAGLE head does (not an MTP layer, which norms them first); the MLP
heads where theirs are packed too. Elsewhere the head runs its modules over float32 weights.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

import torch

from octavo.models.layers.packed import PackedMatmul
from octavo.spec_decode.eagle_head import EagleHead
from octavo_cpu.decoder_stack import DecoderStack, make_decoder_stack
from octavo_cpu.gemm import compiled_packer

DRAFT_WEIGHTS_ENV = "OCTAVO_CPU_DRAFT_WEIGHTS"
DRAFT_WEIGHT_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
DEFAULT_DRAFT_WEIGHTS = "bfloat16"
logger = logging.getLogger(__name__)


class DraftHeadPass:
    """``fn(input_ids, hidden_states, positions, attn_metadata, masked=None) -> hidden``,
    ``compute_logits(hidden_states) -> [R, vocab]`` and ``greedy_drafts(hidden_states) -> int64
    [R]`` (the LM-head product and the argmax in one ``greedy_tokens`` call)."""

    def __init__(self, head: Any, ops: Any, stored: torch.dtype):
        self._greedy_op = ops.greedy_tokens.default
        self._linear = ops.linear.default
        # The target's packed LM head, or a copy of it kept as the head's weights are.
        if stored == torch.bfloat16:
            self._lm_head = ops.pack_linear_weight_bf16(head.lm_head.weight.detach())
        else:
            self._lm_head = _packed_lm_head(head)
        self._vocab = head.embed_tokens.num_embeddings
        self._op = ops.draft_head_inputs.default
        self._run_layers = head.run_layers  # its decoder stack
        self._stack = head.decoder_stack
        self._drafts_op = ops.greedy_head_drafts.default
        self._embedding = head.embed_tokens.weight.detach()
        self._mask_embedding = _parameter(head, "mask_embedding")
        self._mask_hidden = _parameter(head, "mask_hidden")
        self._fc = _packed(head.fc)
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

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        out = torch.empty(hidden_states.shape[0], self._vocab)
        self._linear(out, hidden_states.contiguous(), self._lm_head)
        return out

    def greedy_drafts(self, hidden_states: torch.Tensor) -> torch.Tensor:
        out = torch.empty(hidden_states.shape[0], dtype=torch.int64)
        self._greedy_op(out, hidden_states, self._lm_head, self._vocab)
        return out

    def greedy_head_drafts(self, hidden_states, *step, mlp_drafts: int = 0):
        """``(drafts int64 [R, steps + mlp_drafts], hidden [R, H])``: the head's pass over the
        rows' verified positions and their greedy drafts, serial or parallel, and a Gumiho
        head's ``mlp_drafts`` more, in one ``greedy_head_drafts`` call; ``step`` is ``rows,
        first, num_verified, steps, parallel, token_ids, block_table, block_size`` (the
        ``octavo_draft_head`` hookspec)."""
        shape, scale, eps = self._stack.shape_arguments()
        return self._drafts_op(
            hidden_states.contiguous(),
            *step,
            self._lm_head,
            self._vocab,
            self._embedding,
            self._mask_embedding,
            self._mask_hidden,
            self._fc,
            self._fc_out,
            self._cos,
            self._sin,
            self._stack.weights,
            self._stack.kv_caches(),
            shape,
            scale,
            eps,
            *self._mlp_heads(mlp_drafts),
        )

    def _mlp_heads(self, count: int) -> tuple:
        """``(count, weights, intermediate_size, eps)`` of the MLP heads ``greedy_head_drafts``
        runs: none for a head without them."""
        if count:
            raise ValueError(f"{type(self).__name__} has no MLP heads to draft {count} tokens")
        return 0, [], 0, 0.0


class GumihoHeadPass(DraftHeadPass):
    """A Gumiho head's: its serial head's forward, and ``draft_in_parallel``."""

    def __init__(self, head: Any, ops: Any, stored: torch.dtype):
        super().__init__(head, ops, stored)
        self._mlp_op = ops.draft_mlp_heads.default
        self._mlp_weights = [t for mlp_head in head.parallel_heads for t in _mlp_tensors(mlp_head)]
        first = head.parallel_heads[0]
        self._intermediate_size = first.mlp.gate_up_proj.shard_sizes[0]
        self._eps = first.norm.eps

    def _mlp_heads(self, count: int) -> tuple:
        return count, self._mlp_weights, self._intermediate_size, self._eps

    def draft_in_parallel(self, last_drafts, hidden_states, count: int) -> torch.Tensor:
        """``[count, R, H]``, as ``GumihoHead.draft_in_parallel``."""
        return self._mlp_op(
            last_drafts,
            hidden_states.contiguous(),
            self._embedding,
            self._mlp_weights,
            self._intermediate_size,
            self._eps,
            count,
        )


def draft_weights() -> torch.dtype:
    """``OCTAVO_CPU_DRAFT_WEIGHTS``, checked: the dtype a draft head's packed weights keep."""
    raw = os.environ.get(DRAFT_WEIGHTS_ENV, DEFAULT_DRAFT_WEIGHTS).strip().lower()
    if raw not in DRAFT_WEIGHT_DTYPES:
        raise ValueError(
            f"{DRAFT_WEIGHTS_ENV}={raw!r}: use {' or '.join(DRAFT_WEIGHT_DTYPES)} (the dtype a "
            "draft head's weights are kept in; its products are float32 either way)"
        )
    return DRAFT_WEIGHT_DTYPES[raw]


def describe_draft_weights() -> str:
    """How a draft head's weights are kept, for ``octavo env``."""
    try:
        stored = draft_weights()
    except ValueError as exc:
        return f"not usable: {exc}"
    if stored == torch.float32:
        return f"float32 weights ({DRAFT_WEIGHTS_ENV})"
    return f"bfloat16 weights, float32 products ({DRAFT_WEIGHTS_ENV}=float32 keeps float32)"


def make_draft_head(head: Any, ops: Any) -> Optional[DraftHeadPass]:
    """The one-call forward of ``head`` (with a Gumiho head's MLP heads in one more where they
    fit), or None where it does not apply (the reason is logged at debug level). Where it
    applies, the head's linears are packed again with their weights in ``draft_weights()``."""
    why = _unfit(head, ops)
    if why is not None:
        logger.debug("the draft head runs as modules: %s", why)
        return None
    stored = draft_weights()
    if stored != torch.float32:
        _repack(head, ops, stored)
    mlp_heads = getattr(head, "parallel_heads", None)
    if mlp_heads is None:
        return DraftHeadPass(head, ops, stored)
    why = _mlp_heads_unfit(mlp_heads, ops)
    if why is not None:
        logger.debug("the MLP heads run as modules: %s", why)
        return DraftHeadPass(head, ops, stored)
    return GumihoHeadPass(head, ops, stored)


def _repack(head: Any, ops: Any, stored: torch.dtype) -> None:
    """Pack the head's linears (its layer's, ``fc``, any MLP heads') again with their weights
    kept in ``stored``, and its decoder stack over them; the LM-head copy its greedy drafts are
    scored by is packed the same way (``DraftHeadPass``)."""
    pack = compiled_packer(torch.float32, stored=stored)
    for layer in head.modules():
        if isinstance(getattr(layer, "quant_method", None), PackedMatmul):
            layer.quant_method = PackedMatmul(layer, pack)
    head.decoder_stack = make_decoder_stack(head.layers, head.norm, ops)


def _unfit(head: Any, ops: Any) -> Optional[str]:
    kernels = ("draft_head_inputs", "greedy_tokens", "greedy_head_drafts")
    if ops is None or not all(hasattr(ops, op) for op in kernels):
        return f"no compiled {', '.join(kernels)} kernels"
    if not isinstance(head, EagleHead):
        return f"{type(head).__name__} is not an EAGLE-family head"
    methods = ("inputs", "predict", "compute_logits")
    if any(getattr(type(head), m) is not getattr(EagleHead, m) for m in methods):
        return f"{type(head).__name__} reads its inputs or scores its drafts its own way"
    if not isinstance(head.decoder_stack, DecoderStack):
        return "its layers do not run as a compiled decoder stack"
    embedding = head.embed_tokens
    if getattr(embedding, "tp", None) is None or embedding.tp.size != 1:
        return "a vocabulary split across tensor-parallel ranks"
    if _packed(head.fc) is None:
        return "fc is not packed for the compiled GEMM"
    if _packed_lm_head(head) is None:
        return "the target's LM head is not packed for the compiled GEMM on one rank"
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


def _packed(linear: Any, start: int = 0, size: Optional[int] = None) -> Optional[torch.Tensor]:
    """The compiled GEMM's packed weight of ``linear``'s rows ``start .. start + size`` (all
    of them by default), or None where it has none (a bias, another GEMM, widened)."""
    method = getattr(linear, "quant_method", None)
    if linear.bias is not None or not isinstance(method, PackedMatmul) or method.widened:
        return None
    product = method.product_for(start, linear.weight.shape[0] if size is None else size)
    return getattr(product, "packed", None)


def _packed_lm_head(head: Any) -> Optional[torch.Tensor]:
    """The compiled GEMM's packed weight of the target's LM head (the head's drafts are scored
    by it), or None (widened, another GEMM, quantized rows, its vocabulary split across ranks)."""
    lm_head = head.lm_head
    if lm_head.tp.size != 1 or lm_head.widened_weight is not None:
        return None
    if lm_head.weight.dtype != torch.float32:
        return None
    packed = getattr(lm_head.packed, "packed", None)
    return packed if packed is not None and packed.dtype == torch.float32 else None


def _mlp_tensors(mlp_head: Any) -> list[Optional[torch.Tensor]]:
    """An MLP head's 6 tensors in draft_mlp_heads' order: fc, mlp_norm, gate, up, down, norm."""
    gate_up = mlp_head.mlp.gate_up_proj
    (gate_start, up_start), (gate_size, up_size) = gate_up.shard_offsets, gate_up.shard_sizes
    return [
        _packed(mlp_head.fc),
        mlp_head.mlp_norm.weight.detach(),
        _packed(gate_up, gate_start, gate_size),
        _packed(gate_up, up_start, up_size),
        _packed(mlp_head.mlp.down_proj),
        mlp_head.norm.weight.detach(),
    ]


def _mlp_heads_unfit(mlp_heads: Any, ops: Any) -> Optional[str]:
    if not hasattr(ops, "draft_mlp_heads") or len(mlp_heads) == 0:
        return "no compiled draft_mlp_heads kernel, or no MLP heads"
    tensors = [t for mlp_head in mlp_heads for t in _mlp_tensors(mlp_head)]
    if any(t is None for t in tensors):
        return "a linear not packed for the compiled GEMM"
    norms = [n.weight for h in mlp_heads for n in (h.mlp_norm, h.norm)]
    if any(n.dtype != torch.float32 for n in norms):
        return "the MLP heads compute in float32"
    if len({h.mlp.gate_up_proj.shard_sizes for h in mlp_heads}) != 1:
        return "the MLP heads differ in shape"
    if len({norm.eps for h in mlp_heads for norm in (h.mlp_norm, h.norm)}) != 1:
        return "the MLP heads' norms differ in eps"
    if any(h.mlp.down_proj.tp.size != 1 for h in mlp_heads):
        return "tensor parallelism"
    return None
