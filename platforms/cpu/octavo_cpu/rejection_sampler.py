"""The cpu platform's speculative-decoding verifier (the contract: ``RejectionSamplerFn``).

Same results as ``octavo.ops.reference.rejection_sample`` for the same draws, with less memory
traffic: the acceptance test reads one probability per draft (not the draft's whole target
row), argmax rows are read only for greedy requests, the request layout is computed with numpy
on the host (the counts are host integers already), and an all-greedy batch never touches the
noise. An all-greedy batch (the usual case of a benchmark, and of n-gram drafts at batch 1) is
one argmax over the target rows and the rest in numpy: a handful of calls where the general
path makes a few dozen torch calls, each costing more than its arithmetic on a verify step's
few rows. Argmax rows go through ``argmax`` (the plugin passes the compiled one: torch's costs
~55 us on a verify step's five rows of the demo model's vocabulary, the compiled one ~8), and an
all-greedy batch through ``greedy`` (the plugin's: the compiled ``greedy_verify``, one call that
takes each request's argmax rows only up to its first rejection).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from octavo_cpu.sampler import make_argmax, torch_argmax

GreedyVerifyFn = Callable[[torch.Tensor, np.ndarray, torch.Tensor], torch.Tensor]
"""``greedy(draft_token_ids, num_drafts [R] (numpy int64), target_logits) -> [R, max_k + 1]``:
the all-greedy verification (:func:`greedy_verify`'s result)."""


def rejection_sample(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: Sequence[int],
    draft_probs: Optional[torch.Tensor],
    target_probs: torch.Tensor,
    temperature: torch.Tensor,
    uniforms: torch.Tensor,
    noise: torch.Tensor,
    *,
    argmax=torch_argmax,
    greedy: Optional[GreedyVerifyFn] = None,
) -> torch.Tensor:
    """``[R, max_k + 1]`` int64: accepted drafts, the recovered or bonus token, -1 padding;
    ``argmax(rows [N, V]) -> [N]`` takes greedy rows' argmax, ``greedy`` verifies an all-greedy
    batch (default: :func:`greedy_verify` with ``argmax``)."""
    k = np.asarray(num_draft_tokens, dtype=np.int64)
    if not temperature.numpy().any():  # host tensors here: numpy reads them in place
        if greedy is not None:
            return greedy(draft_token_ids, k, target_probs)
        return greedy_verify(draft_token_ids, k, target_probs, argmax)
    num_reqs, num_drafts = len(k), int(k.sum())
    first = np.cumsum(k) - k
    owner = np.repeat(np.arange(num_reqs), k)
    offset = np.arange(num_drafts) - first[owner]
    row_of_draft = first[owner] + owner + offset  # request r's target rows start at first + r
    is_greedy = temperature == 0
    owner_t, offset_t = torch.from_numpy(owner), torch.from_numpy(offset)
    target_row = torch.from_numpy(row_of_draft)
    drafts = draft_token_ids.long()

    # Accept each draft on its own: greedy rows compare with the argmax, the others race a uniform.
    p_draft = target_probs[target_row, drafts]
    q_draft = draft_probs[torch.arange(num_drafts), drafts] if draft_probs is not None else 1.0
    ok = uniforms * q_draft < p_draft
    greedy_draft = is_greedy[owner_t]
    if bool(greedy_draft.any()):
        ok[greedy_draft] = argmax(target_probs[target_row[greedy_draft]]) == drafts[greedy_draft]

    # Accepted count: the first rejection of each request (k_r when there is none).
    rejected_at = torch.from_numpy(k.copy())
    bad = ~ok
    rejected_at.scatter_reduce_(0, owner_t[bad], offset_t[bad], reduce="amin")
    k_t = torch.from_numpy(k)

    out = torch.full((num_reqs, int(k.max(initial=0)) + 1), -1, dtype=torch.int64)
    keep = offset_t < rejected_at[owner_t]
    out[owner_t[keep], offset_t[keep]] = drafts[keep]

    # The last token reads the target row after the accepted drafts.
    reqs = torch.arange(num_reqs)
    p_last = target_probs[torch.from_numpy(first) + reqs + rejected_at]
    last = argmax(p_last)
    if not bool(is_greedy.all()):
        stopped = rejected_at < k_t
        weights = p_last.clone()
        rows = reqs[stopped]
        if rows.numel():
            at = torch.from_numpy(first)[rows] + rejected_at[rows]
            if draft_probs is None:
                sub = torch.zeros_like(p_last[rows]).scatter_(1, drafts[at, None], 1.0)
            else:
                sub = draft_probs[at]
            residual = (p_last[rows] - sub).clamp(min=0)
            weights[rows] = torch.where(residual.amax(-1, keepdim=True) > 0, residual, p_last[rows])
        last = torch.where(is_greedy, last, (weights / noise).argmax(-1))
    out[reqs, rejected_at] = last
    return out


def greedy_verify(
    draft_token_ids, k: np.ndarray, target_probs, argmax=torch_argmax
) -> torch.Tensor:
    """Every request greedy: its drafts are kept while each is the target's argmax at its
    position, then the argmax after the last kept one (the recovered or bonus token). ``k [R]``
    drafts per request; request r's target rows start at (its drafts before it) + r."""
    num_reqs = len(k)
    first = np.cumsum(k) - k
    owner = np.repeat(np.arange(num_reqs), k)
    offset = np.arange(int(k.sum())) - first[owner]
    row_of_draft = first[owner] + owner + offset
    best = argmax(target_probs).numpy()  # [sum(k + 1)]: request r's rows start at first + r
    drafts = draft_token_ids.numpy()
    rejected_at = k.copy()  # the first draft that is not the argmax (k: none)
    wrong = best[row_of_draft] != drafts
    np.minimum.at(rejected_at, owner[wrong], offset[wrong])
    out = np.full((num_reqs, int(k.max(initial=0)) + 1), -1, dtype=np.int64)
    keep = offset < rejected_at[owner]
    out[owner[keep], offset[keep]] = drafts[keep]
    reqs = np.arange(num_reqs)
    out[reqs, rejected_at] = best[first + reqs + rejected_at]
    return torch.from_numpy(out)


def make_greedy_verify(ops: Any) -> GreedyVerifyFn:
    """The all-greedy verification: the compiled ``greedy_verify`` where the kernels have it
    (float32 logits), else :func:`greedy_verify` over ``ops``' argmax."""
    argmax = make_argmax(ops)
    fallback = functools.partial(greedy_verify, argmax=argmax)
    if ops is None or not hasattr(ops, "greedy_verify"):
        return fallback
    op = ops.greedy_verify.default

    def compiled(draft_token_ids, k: np.ndarray, target_logits) -> torch.Tensor:
        if target_logits.dtype != torch.float32:
            return fallback(draft_token_ids, k, target_logits)
        out = torch.empty(len(k), int(k.max(initial=0)) + 1, dtype=torch.int64)
        drafts = draft_token_ids.to(torch.int64).contiguous()
        op(out, target_logits.contiguous(), drafts, torch.from_numpy(k))
        return out

    return compiled
