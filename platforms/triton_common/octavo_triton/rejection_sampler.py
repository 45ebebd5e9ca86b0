"""The speculative-decoding verifier as one Triton kernel (the contract: ``RejectionSamplerFn``).

A program verifies ``BLOCK_R`` requests; every per-request quantity is a ``[BLOCK_R]`` vector.
First a walk over draft positions ``j < max_k`` accepts each live request's ``j``-th draft
(greedy: equal to the target row's argmax; random: ``u * q(x) < p(x)``) and stops a request at
its first rejection. Then one pass over the vocabulary in ``[BLOCK_R, BLOCK_V]`` chunks draws
the last token from the one target row it depends on: the exponential race
``argmax(weights / noise)`` over the residual ``max(p - q, 0)`` after a rejection (``p`` when
the residual is all zero), over ``p`` at the bonus position. Divisions round to nearest
(``div_rn``), so the draw is the reference's bit for bit on a GPU too, not only in the
interpreter. Greedy argmaxes come from one ``torch.argmax`` over the target rows before the
launch (lowest index on ties, as the reference); no host sync anywhere.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from octavo_triton.runtime import interpreting, next_power_of_2
from octavo_triton.tuning import SamplerTuning


@triton.jit
def rejection_sample_kernel(
    out_ptr,
    draft_ptr,
    draft_probs_ptr,
    target_probs_ptr,
    target_argmax_ptr,
    cu_ptr,
    temperature_ptr,
    uniforms_ptr,
    noise_ptr,
    num_reqs,
    vocab_size,
    max_k,
    stride_out,
    stride_draft_probs,
    stride_target,
    stride_noise,
    HAS_DRAFT_PROBS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    reqs = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    req_ok = reqs < num_reqs
    first = tl.load(cu_ptr + reqs, mask=req_ok, other=0)
    k = tl.load(cu_ptr + reqs + 1, mask=req_ok, other=0) - first
    greedy = tl.load(temperature_ptr + reqs, mask=req_ok, other=0.0) == 0.0
    out_rows = out_ptr + reqs.to(tl.int64) * stride_out

    # Walk the drafts; a request stays live while every draft so far was accepted.
    num_accepted = tl.zeros([BLOCK_R], tl.int32)
    live = req_ok
    for j in range(0, max_k):
        live = live & (j < k)
        at = first + j
        token = tl.load(draft_ptr + at, mask=live, other=0)
        target_row = (at + reqs).to(tl.int64)
        argmax = tl.load(target_argmax_ptr + target_row, mask=live, other=-1)
        p = tl.load(target_probs_ptr + target_row * stride_target + token, mask=live, other=0.0)
        if HAS_DRAFT_PROBS:
            q = tl.load(
                draft_probs_ptr + at.to(tl.int64) * stride_draft_probs + token, mask=live, other=1.0
            )
        else:
            q = 1.0
        u = tl.load(uniforms_ptr + at, mask=live, other=1.0)
        accept = tl.where(greedy, token == argmax, u * q < p)
        live = live & accept
        tl.store(out_rows + j, token, mask=live)
        num_accepted += live.to(tl.int32)

    # The last token, from target row first + r + accepted: recovered or bonus.
    last_row = (first + reqs + num_accepted).to(tl.int64)
    greedy_last = tl.load(target_argmax_ptr + last_row, mask=req_ok, other=0)
    rejected = num_accepted < k
    at = (first + num_accepted).to(tl.int64)
    rejected_token = tl.load(draft_ptr + at, mask=req_ok & rejected, other=-1)
    best_res = tl.full([BLOCK_R], -1.0, tl.float32)
    best_res_idx = tl.zeros([BLOCK_R], tl.int64)
    best_p = tl.full([BLOCK_R], -1.0, tl.float32)
    best_p_idx = tl.zeros([BLOCK_R], tl.int64)
    res_max = tl.zeros([BLOCK_R], tl.float32)
    for v0 in range(0, vocab_size, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        mask = req_ok[:, None] & (offs < vocab_size)[None, :]
        p = tl.load(
            target_probs_ptr + last_row[:, None] * stride_target + offs[None, :],
            mask=mask,
            other=0.0,
        )
        if HAS_DRAFT_PROBS:
            q = tl.load(
                draft_probs_ptr + at[:, None] * stride_draft_probs + offs[None, :],
                mask=mask & rejected[:, None],
                other=0.0,
            )
        else:
            q = tl.where(offs[None, :] == rejected_token[:, None], 1.0, 0.0)
        residual = tl.where(rejected[:, None], tl.maximum(p - q, 0.0), p)
        res_max = tl.maximum(res_max, tl.max(residual, axis=1))
        noise = tl.load(
            noise_ptr + reqs.to(tl.int64)[:, None] * stride_noise + offs[None, :],
            mask=mask,
            other=1.0,
        )
        val, idx = tl.max(
            tl.where(mask, tl.math.div_rn(residual, noise), -1.0), axis=1, return_indices=True
        )
        better = val > best_res
        best_res_idx = tl.where(better, v0 + idx, best_res_idx)
        best_res = tl.where(better, val, best_res)
        val, idx = tl.max(
            tl.where(mask, tl.math.div_rn(p, noise), -1.0), axis=1, return_indices=True
        )
        better = val > best_p
        best_p_idx = tl.where(better, v0 + idx, best_p_idx)
        best_p = tl.where(better, val, best_p)
    drawn = tl.where(res_max > 0.0, best_res_idx, best_p_idx)
    tl.store(out_rows + num_accepted, tl.where(greedy, greedy_last, drawn), mask=req_ok)


def make_rejection_sampler(tuning: SamplerTuning = SamplerTuning()):
    """Return ``fn(draft_token_ids, num_draft_tokens, draft_probs, target_probs, temperature,
    uniforms, noise) -> [R, max_k + 1]`` int64 (the hook's contract)."""
    interpret = interpreting()
    launch = {} if interpret else {"num_warps": tuning.num_warps}

    def rejection_sample(
        draft_token_ids: torch.Tensor,
        num_draft_tokens: Sequence[int],
        draft_probs: Optional[torch.Tensor],
        target_probs: torch.Tensor,
        temperature: torch.Tensor,
        uniforms: torch.Tensor,
        noise: torch.Tensor,
    ) -> torch.Tensor:
        """Accepted drafts, then the recovered or bonus token, then -1, per request."""
        counts = [int(n) for n in num_draft_tokens]
        num_reqs, vocab = len(counts), target_probs.shape[-1]
        device = target_probs.device
        max_k = max(counts, default=0)
        out = torch.full((num_reqs, max_k + 1), -1, dtype=torch.int64, device=device)
        if num_reqs == 0:
            return out
        cu = (
            torch.tensor([0] + counts, dtype=torch.int32)
            .cumsum(0, dtype=torch.int32)
            .to(device, non_blocking=True)
        )
        target_probs = target_probs.float()
        if target_probs.stride(-1) != 1:
            target_probs = target_probs.contiguous()
        has_draft_probs = draft_probs is not None
        if has_draft_probs:
            draft_probs = draft_probs.float()
            if draft_probs.stride(-1) != 1:
                draft_probs = draft_probs.contiguous()
        noise = noise.float()
        if noise.stride(-1) != 1:
            noise = noise.contiguous()
        temperature = temperature.to(device=device, dtype=torch.float32)
        drafts, uniforms = draft_token_ids.long(), uniforms.float()
        if drafts.numel() == 0:  # no drafts: nothing reads these, but the pointers must be real
            drafts, uniforms = out, target_probs
        block_r = min(
            tuning.interpreter_block_r if interpret else tuning.block_r, next_power_of_2(num_reqs)
        )
        rejection_sample_kernel[(triton.cdiv(num_reqs, block_r),)](
            out,
            drafts,
            draft_probs if has_draft_probs else target_probs,
            target_probs,
            target_probs.argmax(-1),
            cu,
            temperature,
            uniforms,
            noise,
            num_reqs,
            vocab,
            max_k,
            out.stride(0),
            draft_probs.stride(0) if has_draft_probs else 0,
            target_probs.stride(0),
            noise.stride(0),
            HAS_DRAFT_PROBS=has_draft_probs,
            BLOCK_R=block_r,
            BLOCK_V=min(tuning.block_v, next_power_of_2(max(16, vocab))),
            **launch,
        )
        return out

    return rejection_sample
