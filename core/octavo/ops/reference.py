"""Reference kernels: pure torch, written to be read, the oracle every platform is tested against.

Nothing here is fast. Each function states the exact semantics a platform's kernel must match;
``octavo.testing.conformance`` compares platforms with these.
"""

from __future__ import annotations

from typing import Optional

import torch

from octavo.ops.reference_mla import (  # noqa: F401 (the MLA oracle, in its own module)
    ReferenceMLABackend,
    mla_attention,
)
from octavo.ops.reference_moe import (  # noqa: F401 (the MoE oracle, in its own module)
    fused_moe,
    pack_fused_moe,
    select_experts,
)
from octavo.platform.types import AttentionMetadata, LoRAMapping, SamplingMetadata

# --- paged attention -------------------------------------------------------------------------


def write_kv(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store new K/V at their slots. Layout ``[2, num_blocks, block_size, kv_heads, head_dim]``;
    a slot of -1 is padding and is skipped."""
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    flat[0, slots] = key[: slot_mapping.shape[0]][valid].to(kv_cache.dtype)
    flat[1, slots] = value[: slot_mapping.shape[0]][valid].to(kv_cache.dtype)


def gather_context(kv_cache: torch.Tensor, block_ids: torch.Tensor, seq_len: int):
    """K and V of one request's first ``seq_len`` tokens, read through its block ids."""
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    num_blocks = -(-seq_len // block_size)
    blocks = block_ids[:num_blocks].long()
    k = kv_cache[0, blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]
    v = kv_cache[1, blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]
    return k, v


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: Optional[int] = None,
) -> torch.Tensor:
    """Attention for a flat batch mixing prefill chunks and decodes, over a paged KV cache.

    First writes the new tokens' K/V through ``slot_mapping``; then each new token of request
    ``r`` (at position ``p``) attends to the request's context positions ``0..p`` read through
    ``block_table[r]`` (and only to the last ``sliding_window`` of them when set). GQA: query
    head ``h`` uses KV head ``h // (num_heads // num_kv_heads)``. Computed in float32, returned
    in ``query.dtype``. Rows of padding tokens (beyond the last request) are zero here; a
    platform kernel may leave anything there, and callers ignore them.
    """
    write_kv(key, value, kv_cache, metadata.slot_mapping)
    num_heads = query.shape[1]
    out = torch.zeros_like(query)
    qsl = metadata.query_start_loc.tolist()
    seq_lens = metadata.seq_lens.tolist()
    for r, seq_len in enumerate(seq_lens):
        start, end = qsl[r], qsl[r + 1]
        query_len = end - start
        if query_len == 0:
            continue
        k, v = gather_context(kv_cache, metadata.block_table[r], seq_len)
        group = num_heads // k.shape[1]
        k = k.repeat_interleave(group, dim=1).float()
        v = v.repeat_interleave(group, dim=1).float()
        q = query[start:end].float()
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        q_pos = torch.arange(seq_len - query_len, seq_len, device=query.device).unsqueeze(1)
        k_pos = torch.arange(seq_len, device=query.device).unsqueeze(0)
        masked = k_pos > q_pos
        if sliding_window is not None:
            masked |= k_pos <= q_pos - sliding_window
        scores = scores.masked_fill(masked, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    return out


# --- RMSNorm ---------------------------------------------------------------------------------


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: Optional[torch.Tensor] = None,
):
    """``rms_norm(x) * weight`` as HuggingFace Llama computes it (statistics in float32, the
    product with ``weight`` in the input dtype). With ``residual``: the residual is added first,
    in the input dtype, and the pair ``(normed, x + residual)`` is returned."""
    if residual is not None:
        x = x + residual
        new_residual = x
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * h.to(x.dtype)
    return (out, new_residual) if residual is not None else out


# --- rotary embedding ------------------------------------------------------------------------


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_embedding(cos_sin, query: torch.Tensor, key: torch.Tensor, head_dim: int):
    """Rotate flat ``query [T, heads*head_dim]`` and ``key [T, kv_heads*head_dim]`` by the step's
    ``(cos, sin)`` (``[T, 1, head_dim]`` each, in the activations' dtype): ``x * cos +
    rotate_half(x) * sin`` in that dtype, as transformers computes it (so bfloat16 results
    agree with it bit for bit). Returns both as ``[T, heads, head_dim]``; the inputs are left as
    they were."""
    cos, sin = cos_sin
    tokens = query.shape[0]
    q = query.view(tokens, query.shape[1] // head_dim, head_dim)
    k = key.view(tokens, key.shape[1] // head_dim, head_dim)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


# --- activation ------------------------------------------------------------------------------


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``, the SwiGLU of the Llama MLP, as HuggingFace computes it (each op in
    the input dtype)."""
    return torch.nn.functional.silu(gate) * up


# --- LoRA ------------------------------------------------------------------------------------


def lora_shrink(x: torch.Tensor, a_stacked: torch.Tensor, mapping: LoRAMapping) -> torch.Tensor:
    """``[T, R]`` float32: each token's ``x @ A.T`` with its slot's ``A`` (zeros without one),
    one product per adapter of the step over the rows grouped by ``mapping``."""
    out = torch.zeros(x.shape[0], a_stacked.shape[1], dtype=torch.float32, device=x.device)
    for slot, rows in _lora_segments(mapping):
        out[rows] = x[rows].float() @ a_stacked[slot].float().T
    return out


def lora_expand(
    y: torch.Tensor,
    buffer: torch.Tensor,
    b_stacked: torch.Tensor,
    mapping: LoRAMapping,
    offset: int,
) -> None:
    """``y[t, offset : offset + N] += buffer[t] @ B.T`` with token ``t``'s slot's ``B``, the sum
    in float32 and rounded once; rows without an adapter untouched."""
    width = b_stacked.shape[1]
    for slot, rows in _lora_segments(mapping):
        delta = buffer[rows] @ b_stacked[slot].float().T
        target = y[rows, offset : offset + width]
        y[rows, offset : offset + width] = (target.float() + delta).to(y.dtype)


def _lora_segments(mapping: LoRAMapping):
    starts = mapping.host_segment_starts
    for g, slot in enumerate(mapping.host_segment_slots):
        yield slot, mapping.sorted_tokens[starts[g] : starts[g + 1]]


class _ReferenceLoRAKernels:
    """:func:`lora_shrink` and :func:`lora_expand` as a platform's ``LoRAKernels``."""

    shrink = staticmethod(lora_shrink)
    expand = staticmethod(lora_expand)


LORA_KERNELS = _ReferenceLoRAKernels()


# --- sampling --------------------------------------------------------------------------------


def apply_top_k_top_p_min_p(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Mask (to -inf) what top-k, then top-p, then min-p exclude, per row. Returns a new tensor.

    top-k keeps the ``k`` largest logits (ties at the k-th value are kept; ``k`` of 0 or beyond
    the vocabulary keeps all); top-p keeps the smallest set of most-likely tokens whose
    probability reaches ``p`` (always at least one; ``p >= 1`` keeps all, whatever the float
    rounding of the cumulative sum); min-p keeps tokens whose probability is at least ``min_p``
    times the row's largest.
    """
    logits = logits.clone()
    vocab = logits.shape[-1]
    k = metadata.top_k.long()
    k = torch.where((k <= 0) | (k > vocab), torch.full_like(k, vocab), k)
    sorted_logits = logits.sort(dim=-1, descending=True).values
    kth = sorted_logits.gather(1, (k - 1).unsqueeze(1))
    logits = logits.masked_fill(logits < kth, float("-inf"))

    sorted_logits, order = logits.sort(dim=-1, descending=True)
    sorted_probs = sorted_logits.softmax(dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    top_p = metadata.top_p.unsqueeze(1)
    drop_sorted = (mass_before >= top_p) & (top_p < 1.0)
    drop_sorted[:, 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    logits = logits.masked_fill(drop, float("-inf"))

    probs = logits.softmax(dim=-1)
    threshold = metadata.min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < threshold, float("-inf"))


def exponential_noise(shape, metadata: SamplingMetadata, device=None) -> torch.Tensor:
    """Exp(1) noise per row; rows with a seeded generator draw from it alone, so a seeded
    request samples the same tokens whatever else is in the batch."""
    q = torch.empty(shape, dtype=torch.float32, device=device).exponential_()
    for row, generator in metadata.generators.items():
        q[row].exponential_(generator=generator)
    return q


def sample(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Sample one token id per row of ``logits [R, V]``.

    Temperature 0 is greedy (argmax, lowest index on ties). Otherwise: divide by temperature,
    apply top-k/top-p/min-p, and draw from the softmax by the exponential race
    ``argmax(probs / q)``, ``q ~ Exp(1)`` (from the row's generator when it has one).
    """
    logits = logits.float()
    greedy = logits.argmax(dim=-1)
    if metadata.all_greedy:
        return greedy
    temperature = metadata.temperature.float()
    safe_temperature = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    scaled = apply_top_k_top_p_min_p(logits / safe_temperature.unsqueeze(1), metadata)
    probs = scaled.softmax(dim=-1)
    q = exponential_noise(probs.shape, metadata, probs.device)
    sampled = (probs / q).argmax(dim=-1)
    return torch.where(temperature > 0, sampled, greedy)


# --- structured output -----------------------------------------------------------------------


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[R, ceil(V/32)] int32`` -> ``[R, V] bool``; bit ``i`` of word ``j`` is token ``32j+i``."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_token_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, indices: Optional[torch.Tensor] = None
) -> None:
    """In place: logits of disallowed tokens (bit 0) become -inf. ``indices[i]`` is the logits
    row that bitmask row ``i`` applies to (default: row ``i``)."""
    allowed = unpack_bitmask(bitmask, logits.shape[-1])
    if indices is None:
        rows = torch.arange(bitmask.shape[0], device=logits.device)
    else:
        rows = indices.long()
    logits[rows] = logits[rows].masked_fill(~allowed.to(logits.device), float("-inf"))


# --- FP8 -------------------------------------------------------------------------------------


def scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``(a @ b) * scale_a * scale_b (+ bias)`` in float32, cast to ``out_dtype``. ``a [M, K]``,
    ``b [K, N]``; ``scale_a`` is ``[1]`` or ``[M, 1]``, ``scale_b`` is ``[1]`` or ``[1, N]``."""
    out = (a.float() @ b.float()) * scale_a.float() * scale_b.float()
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


# --- weight-only quantized linear layers ----------------------------------------------------


def dequantize_rows(raw: torch.Tensor, quant_type: str, in_features: int) -> torch.Tensor:
    """``raw uint8 [N, row_bytes]`` (see ``octavo.quantization.quant_types``) -> the weight
    ``float32 [N, in_features]`` it holds: GGUF's types as the ``gguf`` package dequantizes
    them, ``int8`` rows as ``int8 values * float32 scale``."""
    from octavo.quantization.quant_types import INT8, gguf_quant_type, row_bytes

    raw = raw.contiguous()
    assert raw.dtype == torch.uint8 and raw.dim() == 2
    assert raw.shape[1] == row_bytes(quant_type, in_features)
    if quant_type == INT8:
        values = raw[:, :in_features].view(torch.int8).float()
        scale = raw[:, in_features:].contiguous().view(torch.float32)
        return values * scale
    from gguf.quants import dequantize

    out = dequantize(raw.cpu().numpy(), gguf_quant_type(quant_type))
    return torch.from_numpy(out.reshape(raw.shape[0], in_features).copy()).to(raw.device)


def quantized_linear(
    x: torch.Tensor, raw: torch.Tensor, quant_type: str, in_features: int
) -> torch.Tensor:
    """``x [M, K] @ W^T`` in float32 over the dequantized weight, cast to ``x.dtype``: the
    product a platform's kernel over the quantized rows must approach (it may quantize ``x`` as
    well, see the conformance suite's budget)."""
    weight = dequantize_rows(raw, quant_type, in_features)
    return (x.float() @ weight.t()).to(x.dtype)


# --- speculative decoding ----------------------------------------------------------------------


def draw_rejection_randoms(
    num_draft_tokens, vocab_size: int, generators: Optional[dict] = None, device=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The draws ``rejection_sample`` takes: ``uniforms [N]`` in [0, 1) and ``noise [R, V]`` of
    Exp(1). Request ``r`` with a generator in ``generators`` draws its ``k_r`` uniforms and
    then its noise row from that generator alone, so a seeded request verifies the same way
    whatever else is in the batch; the others draw from the global generator."""
    counts = [int(k) for k in num_draft_tokens]
    uniforms = torch.rand(sum(counts), device=device)
    noise = torch.empty(len(counts), vocab_size, device=device).exponential_()
    starts = [sum(counts[:r]) for r in range(len(counts))]
    for r, generator in (generators or {}).items():
        uniforms[starts[r] : starts[r] + counts[r]] = torch.rand(
            counts[r], generator=generator, device=device
        )
        noise[r].exponential_(generator=generator)
    return uniforms, noise


def rejection_sample(
    draft_token_ids: torch.Tensor,
    num_draft_tokens,
    draft_probs: Optional[torch.Tensor],
    target_probs: torch.Tensor,
    temperature: torch.Tensor,
    uniforms: torch.Tensor,
    noise: torch.Tensor,
) -> torch.Tensor:
    """Speculative-decoding verification (``octavo.platform.types.RejectionSamplerFn`` states
    the contract): ``[R, max_k + 1]`` int64, each row its accepted drafts, then the recovered or
    bonus token, then -1.

    Written without a loop over requests: drafts are laid out in a padded ``[R, max_k]`` grid,
    the accepted count is the length of each row's leading run of accepted drafts, and the
    last token of every row is drawn from the one target row it depends on.
    """
    device = target_probs.device
    counts = torch.as_tensor([int(k) for k in num_draft_tokens], dtype=torch.int64, device=device)
    num_reqs, max_k = counts.shape[0], int(counts.max()) if counts.numel() else 0
    starts = counts.cumsum(0) - counts  # first draft of each request in the flat layout
    draft_ids = draft_token_ids.long()
    req = torch.repeat_interleave(torch.arange(num_reqs, device=device), counts)  # [N]
    pos = torch.arange(draft_ids.shape[0], device=device) - starts[req]  # [N] index in its request
    greedy = temperature.float() == 0

    # Accept or reject every draft on its own.
    p_rows = target_probs[starts[req] + req + pos].float()  # [N, V]: the draft positions' rows
    p_x = p_rows.gather(1, draft_ids[:, None])[:, 0]
    q_x = (
        torch.ones_like(p_x)
        if draft_probs is None
        else draft_probs.float().gather(1, draft_ids[:, None])[:, 0]
    )
    accept = torch.where(greedy[req], draft_ids == p_rows.argmax(1), uniforms.float() * q_x < p_x)

    # The leading run of accepted drafts (padding past k_r counts as accepted, then is cut off).
    grid = torch.ones(num_reqs, max_k, dtype=torch.bool, device=device)
    grid[req, pos] = accept
    num_accepted = torch.minimum(grid.long().cumprod(1).sum(1), counts)

    # The last token: recovered at the first rejection, else the bonus; both read target row
    # cu_r + r + accepted. The residual subtracts the rejected draft's probabilities.
    final_p = target_probs[
        starts + torch.arange(num_reqs, device=device) + num_accepted
    ].float()  # [R, V]
    rejected = num_accepted < counts
    draft_at = (starts + num_accepted).clamp(max=max(draft_ids.shape[0] - 1, 0))
    if draft_ids.shape[0] == 0:
        final_q = torch.zeros_like(final_p)
    elif draft_probs is None:
        final_q = torch.nn.functional.one_hot(draft_ids[draft_at], final_p.shape[1]).float()
    else:
        final_q = draft_probs[draft_at].float()
    residual = torch.where(rejected[:, None], (final_p - final_q).clamp(min=0), final_p)
    residual = torch.where(residual.amax(1, keepdim=True) > 0, residual, final_p)
    last = torch.where(greedy, final_p.argmax(1), (residual / noise.float()).argmax(1))

    out = torch.full((num_reqs, max_k + 1), -1, dtype=torch.int64, device=device)
    kept = pos < num_accepted[req]
    out[req[kept], pos[kept]] = draft_ids[kept]
    out[torch.arange(num_reqs, device=device), num_accepted] = last
    return out
