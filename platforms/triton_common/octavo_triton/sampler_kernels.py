"""Triton kernel of the sampler: ``BLOCK_R`` rows per program, no sort and no host sync.

Top-k and top-p are thresholds on the temperature-scaled logits, found by a 16-ary search over
an order-preserving int32 key of the float32 values: 8 passes over a row give the exact k-th
largest value, 8 more the exact top-p cut. Min-p is a per-token test against the row's largest
probability. The draw is the exponential race ``argmax(probs / q)`` with the Exp(1) noise ``q``
made by torch from the requests' generators, so a seeded request samples exactly what
``octavo.ops.reference.sample`` samples.

Every per-row quantity is a ``[BLOCK_R]`` vector; a pass over the vocabulary walks
``[BLOCK_R, BLOCK_V]`` chunks. GPUs run one row per program (vocabularies are large); the
interpreter runs many, since its cost is per operation, not per element. The key computation is
inlined in each pass: a nested call costs milliseconds per chunk in the interpreter.
"""

from __future__ import annotations

import triton
import triton.language as tl

INT32_MIN = tl.constexpr(-2147483648)
INT32_MAX = tl.constexpr(2147483647)
FANOUT = tl.constexpr(16)  # pivots tried per pass of the threshold searches (16**8 = 2**32 keys)
SEARCH_PASSES = tl.constexpr(8)


@triton.jit
def order_key(x):
    """An int32 that orders like the float32 ``x`` (-inf lowest)."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def key_value(key):
    """The float32 whose :func:`order_key` is ``key``."""
    key = key.to(tl.int32)
    return tl.where(key >= 0, key, key ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def row_argmax(row_ptrs, row_ok, vocab_size, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr):
    """Each row's largest logit and its lowest index."""
    best_val = tl.full([BLOCK_R], float("-inf"), tl.float32)
    best_idx = tl.zeros([BLOCK_R], tl.int32)
    for start in range(0, vocab_size, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        mask = row_ok[:, None] & (offs < vocab_size)[None, :]
        x = tl.load(row_ptrs[:, None] + offs[None, :], mask=mask, other=float("-inf")).to(
            tl.float32
        )
        val, idx = tl.max(x, axis=1, return_indices=True)
        better = val > best_val
        best_idx = tl.where(better, start + idx, best_idx)
        best_val = tl.where(better, val, best_val)
    return best_val, best_idx


@triton.jit
def top_k_key(
    row_ptrs, row_ok, vocab_size, temperature, k, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr
):
    """Each row's k-th largest key: the largest ``t`` with at least ``k`` keys ``>= t``."""
    lo = tl.full([BLOCK_R], INT32_MIN, tl.int64)
    hi = tl.full([BLOCK_R], INT32_MAX, tl.int64)
    j = tl.arange(0, FANOUT).to(tl.int64)
    for _ in range(SEARCH_PASSES):
        step = (hi - lo + FANOUT) // FANOUT
        pivots = tl.minimum(lo[:, None] + j[None, :] * step[:, None], hi[:, None])
        counts = tl.zeros([BLOCK_R, FANOUT], tl.int32)
        for start in range(0, vocab_size, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            mask = row_ok[:, None] & (offs < vocab_size)[None, :]
            x = tl.load(row_ptrs[:, None] + offs[None, :], mask=mask, other=float("-inf"))
            bits = (x.to(tl.float32) / temperature[:, None]).to(tl.int32, bitcast=True)
            key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)
            key = tl.where(mask, key, INT32_MIN - 1)
            counts += tl.sum((key[:, :, None] >= pivots[:, None, :]).to(tl.int32), axis=1)
        best = tl.max(tl.where(counts >= k[:, None], j[None, :], 0), axis=1)  # j = 0 always holds
        hi = tl.minimum(hi, lo + (best + 1) * step - 1)
        lo = tl.minimum(lo + best * step, hi)
    return lo


@triton.jit
def top_p_key(
    row_ptrs,
    row_ok,
    vocab_size,
    temperature,
    row_max,
    floor_key,
    target,
    BLOCK_R: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Each row's smallest ``t >= floor_key`` whose strictly larger keys hold less than
    ``target`` mass (of ``exp(scaled - row_max)``)."""
    lo = floor_key
    hi = tl.full([BLOCK_R], INT32_MAX, tl.int64)
    j = tl.arange(0, FANOUT).to(tl.int64)
    for _ in range(SEARCH_PASSES):
        step = (hi - lo + FANOUT) // FANOUT
        pivots = tl.minimum(lo[:, None] + j[None, :] * step[:, None], hi[:, None])
        masses = tl.zeros([BLOCK_R, FANOUT], tl.float32)
        for start in range(0, vocab_size, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            mask = row_ok[:, None] & (offs < vocab_size)[None, :]
            x = tl.load(row_ptrs[:, None] + offs[None, :], mask=mask, other=float("-inf"))
            x = x.to(tl.float32) / temperature[:, None]
            bits = x.to(tl.int32, bitcast=True)
            key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)
            e = tl.exp(x - row_max[:, None])
            masses += tl.sum(
                tl.where(key[:, :, None] > pivots[:, None, :], e[:, :, None], 0.0), axis=1
            )
        first = tl.min(tl.where(masses < target[:, None], j[None, :], FANOUT), axis=1)
        new_hi = tl.where(first < FANOUT, tl.minimum(lo + first * step, hi), hi)
        lo = tl.where(first > 0, tl.minimum(lo + (first - 1) * step, hi) + 1, lo)
        hi = new_hi
    return lo


@triton.jit
def kept_mass(
    row_ptrs,
    row_ok,
    vocab_size,
    temperature,
    row_max,
    cut_key,
    num_ties,
    z_kept,
    min_ratio,
    strict_cut: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Sum of ``exp(scaled - row_max)`` over each row's kept tokens: keys above ``cut_key``, the
    first ``num_ties`` (index order) equal to it, and probability ``e / z_kept >= min_ratio``.
    With ``strict_cut`` only keys strictly above the cut count."""
    total = tl.zeros([BLOCK_R], tl.float32)
    ties_seen = tl.zeros([BLOCK_R], tl.int32)
    for start in range(0, vocab_size, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        mask = row_ok[:, None] & (offs < vocab_size)[None, :]
        x = tl.load(row_ptrs[:, None] + offs[None, :], mask=mask, other=float("-inf"))
        x = x.to(tl.float32) / temperature[:, None]
        e = tl.exp(x - row_max[:, None])
        bits = x.to(tl.int32, bitcast=True)
        key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)
        if strict_cut:
            keep = mask & (key > cut_key[:, None])
        else:
            tie = mask & (key == cut_key[:, None])
            rank = ties_seen[:, None] + tl.cumsum(tie.to(tl.int32), axis=1) - 1
            keep = mask & ((key > cut_key[:, None]) | (tie & (rank < num_ties[:, None])))
            keep = keep & (e / z_kept[:, None] >= min_ratio[:, None])
            ties_seen += tl.sum(tie.to(tl.int32), axis=1)
        total += tl.sum(tl.where(keep, e, 0.0), axis=1)
    return total


@triton.jit
def race(
    row_ptrs,
    noise_ptrs,
    row_ok,
    vocab_size,
    temperature,
    row_max,
    cut_key,
    num_ties,
    z_kept,
    min_ratio,
    z_final,
    BLOCK_R: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Each row's ``argmax(probs / q)`` over its kept tokens (lowest index on ties)."""
    best_val = tl.full([BLOCK_R], -1.0, tl.float32)
    best_idx = tl.zeros([BLOCK_R], tl.int32)
    ties_seen = tl.zeros([BLOCK_R], tl.int32)
    for start in range(0, vocab_size, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        mask = row_ok[:, None] & (offs < vocab_size)[None, :]
        x = tl.load(row_ptrs[:, None] + offs[None, :], mask=mask, other=float("-inf"))
        x = x.to(tl.float32) / temperature[:, None]
        e = tl.exp(x - row_max[:, None])
        bits = x.to(tl.int32, bitcast=True)
        key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)
        tie = mask & (key == cut_key[:, None])
        rank = ties_seen[:, None] + tl.cumsum(tie.to(tl.int32), axis=1) - 1
        keep = mask & ((key > cut_key[:, None]) | (tie & (rank < num_ties[:, None])))
        keep = keep & (e / z_kept[:, None] >= min_ratio[:, None])
        ties_seen += tl.sum(tie.to(tl.int32), axis=1)
        q = tl.load(noise_ptrs[:, None] + offs[None, :], mask=mask, other=1.0)
        score = tl.where(keep, (e / z_final[:, None]) / q, -1.0)
        val, idx = tl.max(score, axis=1, return_indices=True)
        better = val > best_val
        best_idx = tl.where(better, start + idx, best_idx)
        best_val = tl.where(better, val, best_val)
    return best_idx


@triton.jit
def any_row(flags):
    """Whether any row of the program needs a step (lets a program skip whole passes)."""
    return tl.max(flags.to(tl.int32), axis=0) > 0


@triton.jit
def filter_and_race(
    row_ptrs,
    noise_ptrs,
    row_ok,
    vocab_size,
    temperature,
    max_logit,
    top_k,
    top_p,
    min_p,
    USE_TOP_K: tl.constexpr,
    USE_TOP_P: tl.constexpr,
    USE_MIN_P: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Top-k, then top-p, then min-p, then the race, for rows with temperature > 0.

    The kept set is always "keys above ``cut_key``, plus the first ``num_ties`` equal to it":
    top-k keeps every tie at the k-th value; top-p keeps ties at its cut in index order while
    the mass before each stays below ``top_p`` (a stable descending sort's order)."""
    # division by t > 0 is monotone, rounding included; rows past the batch get a finite max
    row_max = tl.where(row_ok, max_logit / temperature, 0.0)
    cut_key = tl.full([BLOCK_R], INT32_MIN, tl.int64)
    num_ties = tl.full([BLOCK_R], INT32_MAX, tl.int32)
    no_min = tl.zeros([BLOCK_R], tl.float32)
    ones = no_min + 1.0
    if USE_TOP_K:
        k_on = row_ok & (top_k > 0) & (top_k < vocab_size)
        if any_row(k_on):
            kth = top_k_key(row_ptrs, row_ok, vocab_size, temperature, top_k, BLOCK_R, BLOCK_V)
            cut_key = tl.where(k_on, kth, cut_key)
    z_kept = kept_mass(
        row_ptrs,
        row_ok,
        vocab_size,
        temperature,
        row_max,
        cut_key,
        num_ties,
        ones,
        no_min,
        False,
        BLOCK_R,
        BLOCK_V,
    )
    z_kept = tl.where(row_ok, z_kept, 1.0)
    if USE_TOP_P:
        p_on = row_ok & (top_p < 1.0)
        if any_row(p_on):
            target = top_p * z_kept
            cut = top_p_key(
                row_ptrs,
                row_ok,
                vocab_size,
                temperature,
                row_max,
                cut_key,
                target,
                BLOCK_R,
                BLOCK_V,
            )
            cut = tl.minimum(cut, order_key(row_max).to(tl.int64))  # the top token always stays
            above = kept_mass(
                row_ptrs,
                row_ok,
                vocab_size,
                temperature,
                row_max,
                cut,
                num_ties,
                ones,
                no_min,
                True,
                BLOCK_R,
                BLOCK_V,
            )
            e_cut = tl.exp(key_value(cut) - row_max)
            ties = tl.ceil((target - above) / tl.where(e_cut > 0.0, e_cut, 1.0))
            ties = tl.where(e_cut > 0.0, ties, 2.0e9)
            ties = tl.maximum(tl.minimum(ties, 2.0e9), 1.0).to(tl.int32)
            cut_key = tl.where(p_on, cut, cut_key)
            num_ties = tl.where(p_on, ties, num_ties)
            z_kept = kept_mass(
                row_ptrs,
                row_ok,
                vocab_size,
                temperature,
                row_max,
                cut_key,
                num_ties,
                ones,
                no_min,
                False,
                BLOCK_R,
                BLOCK_V,
            )
            z_kept = tl.where(row_ok, z_kept, 1.0)
    min_ratio = no_min
    z_final = z_kept
    if USE_MIN_P:
        m_on = row_ok & (min_p > 0.0)
        if any_row(m_on):
            min_ratio = tl.where(m_on, min_p * (1.0 / z_kept), 0.0)
            z_final = kept_mass(
                row_ptrs,
                row_ok,
                vocab_size,
                temperature,
                row_max,
                cut_key,
                num_ties,
                z_kept,
                min_ratio,
                False,
                BLOCK_R,
                BLOCK_V,
            )
            z_final = tl.where(row_ok, z_final, 1.0)
    return race(
        row_ptrs,
        noise_ptrs,
        row_ok,
        vocab_size,
        temperature,
        row_max,
        cut_key,
        num_ties,
        z_kept,
        min_ratio,
        z_final,
        BLOCK_R,
        BLOCK_V,
    )


@triton.jit
def sample_kernel(
    out_ptr,
    logits_ptr,
    noise_ptr,
    temperature_ptr,
    top_k_ptr,
    top_p_ptr,
    min_p_ptr,
    num_rows,
    stride_logits,
    stride_noise,
    vocab_size,
    ALL_GREEDY: tl.constexpr,
    USE_TOP_K: tl.constexpr,
    USE_TOP_P: tl.constexpr,
    USE_MIN_P: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """One token id per row: greedy where temperature is 0, else a filtered exponential race."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < num_rows
    row_ptrs = logits_ptr + rows.to(tl.int64) * stride_logits
    max_logit, token = row_argmax(row_ptrs, row_ok, vocab_size, BLOCK_R, BLOCK_V)
    if not ALL_GREEDY:
        temperature = tl.load(temperature_ptr + rows, mask=row_ok, other=0.0)
        if any_row(row_ok & (temperature > 0.0)):
            drawn = filter_and_race(
                row_ptrs,
                noise_ptr + rows.to(tl.int64) * stride_noise,
                row_ok,
                vocab_size,
                tl.where(temperature > 0.0, temperature, 1.0),
                max_logit,
                tl.load(top_k_ptr + rows, mask=row_ok, other=0),
                tl.load(top_p_ptr + rows, mask=row_ok, other=1.0),
                tl.load(min_p_ptr + rows, mask=row_ok, other=0.0),
                USE_TOP_K,
                USE_TOP_P,
                USE_MIN_P,
                BLOCK_R,
                BLOCK_V,
            )
            token = tl.where(temperature > 0.0, drawn, token)
    tl.store(out_ptr + rows, token.to(tl.int64), mask=row_ok)
