"""Triton kernel of the sampler: one program per row, no sort and no host sync.

Top-k and top-p are thresholds on the (temperature-scaled) logits, found by a bitwise binary
search over an order-preserving int32 key of the float32 values: 32 counting passes give the
exact k-th largest value, 32 mass passes the exact top-p cut. Min-p is a per-token test against
the row's largest probability. The draw is the exponential race ``argmax(probs / q)`` with the
Exp(1) noise ``q`` made by torch from the requests' generators, so a seeded request samples
exactly what ``octavo.ops.reference.sample`` samples.
"""

from __future__ import annotations

import triton
import triton.language as tl

INT32_MIN = -2147483648
INT32_MAX = 2147483647
FANOUT = tl.constexpr(16)  # pivots tried per pass of the threshold searches


@triton.jit
def order_key(x):
    """An int32 that orders like the float32 ``x`` (-inf lowest). The passes over the vocabulary
    inline these two lines: a nested call costs milliseconds per chunk in the interpreter."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def row_argmax(row_ptr, vocab_size, BLOCK_V: tl.constexpr):
    """Largest value of the row and its lowest index."""
    best_val = tl.full([], float("-inf"), tl.float32)
    best_idx = tl.zeros([], tl.int32)
    for start in range(0, vocab_size, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        x = tl.load(row_ptr + offs, mask=offs < vocab_size, other=float("-inf")).to(tl.float32)
        val, idx = tl.max(x, axis=0, return_indices=True)
        better = val > best_val
        best_idx = tl.where(better, start + idx, best_idx)
        best_val = tl.where(better, val, best_val)
    return best_val, best_idx


@triton.jit
def counts_at_least(row_ptr, vocab_size, temperature, pivots, BLOCK_V: tl.constexpr):
    """For each pivot, how many scaled logits have ``order_key >= pivot``."""
    counts = tl.zeros([FANOUT], tl.int32)
    for start in range(0, vocab_size, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        x = tl.load(row_ptr + offs, mask=offs < vocab_size, other=float("-inf")).to(tl.float32)
        bits = (x / temperature).to(tl.int32, bitcast=True)
        key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)  # order_key, inlined
        key = tl.where(offs < vocab_size, key, INT32_MIN - 1)
        counts += tl.sum((key[:, None] >= pivots[None, :]).to(tl.int32), axis=0)
    return counts


@triton.jit
def masses_above(row_ptr, vocab_size, temperature, row_max, pivots, BLOCK_V: tl.constexpr):
    """For each pivot, the sum of ``exp(scaled - row_max)`` over keys ``> pivot``."""
    masses = tl.zeros([FANOUT], tl.float32)
    for start in range(0, vocab_size, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        x = tl.load(row_ptr + offs, mask=offs < vocab_size, other=float("-inf")).to(tl.float32)
        x = x / temperature
        bits = x.to(tl.int32, bitcast=True)
        key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)  # order_key, inlined
        e = tl.exp(x - row_max)
        masses += tl.sum(tl.where(key[:, None] > pivots[None, :], e[:, None], 0.0), axis=0)
    return masses


@triton.jit
def mass_above(row_ptr, vocab_size, temperature, row_max, threshold, strict: tl.constexpr,
               BLOCK_V: tl.constexpr):
    """Sum of ``exp(scaled - row_max)`` over keys ``> threshold`` (``>=`` when not strict)."""
    total = tl.zeros([], tl.float32)
    for start in range(0, vocab_size, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        x = tl.load(row_ptr + offs, mask=offs < vocab_size, other=float("-inf")).to(tl.float32)
        x = x / temperature
        bits = x.to(tl.int32, bitcast=True)
        key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # order_key, inlined
        if strict:
            keep = key > threshold
        else:
            keep = key >= threshold
        total += tl.sum(tl.where(keep, tl.exp(x - row_max), 0.0), axis=0)
    return total


@triton.jit
def top_k_key(row_ptr, vocab_size, temperature, k, BLOCK_V: tl.constexpr):
    """The k-th largest key: the largest ``t`` with at least ``k`` keys ``>= t``, by a
    ``FANOUT``-ary search (8 passes over the row for the 2**32 keys)."""
    lo = tl.full([], INT32_MIN, tl.int64)
    hi = tl.full([], INT32_MAX, tl.int64)
    j = tl.arange(0, FANOUT).to(tl.int64)
    while lo < hi:
        step = (hi - lo + FANOUT) // FANOUT
        pivots = tl.minimum(lo + j * step, hi)
        ok = counts_at_least(row_ptr, vocab_size, temperature, pivots, BLOCK_V) >= k
        best = tl.max(tl.where(ok, j, 0), axis=0)  # j = 0 (lo itself) always qualifies
        hi = tl.minimum(hi, lo + (best + 1) * step - 1)
        lo = tl.minimum(lo + best * step, hi)
    return lo


@triton.jit
def top_p_key(row_ptr, vocab_size, temperature, row_max, floor_key, target, BLOCK_V: tl.constexpr):
    """The smallest ``t >= floor_key`` whose strictly-larger tokens hold less than ``target``
    mass, by a ``FANOUT``-ary search: tokens with keys ``>= t`` are the most likely ones
    reaching top-p."""
    lo = floor_key
    hi = tl.full([], INT32_MAX, tl.int64)
    j = tl.arange(0, FANOUT).to(tl.int64)
    while lo < hi:
        step = (hi - lo + FANOUT) // FANOUT
        pivots = tl.minimum(lo + j * step, hi)
        ok = masses_above(row_ptr, vocab_size, temperature, row_max, pivots, BLOCK_V) < target
        first = tl.min(tl.where(ok, j, FANOUT), axis=0)
        new_hi = tl.where(first < FANOUT, tl.minimum(lo + first * step, hi), hi)
        lo = tl.where(first > 0, tl.minimum(lo + (first - 1) * step, hi) + 1, lo)
        hi = new_hi
    return lo


@triton.jit
def key_value(key):
    """The float32 whose :func:`order_key` is ``key``."""
    key = key.to(tl.int32)
    return tl.where(key >= 0, key, key ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def kept_mass(row_ptr, vocab_size, temperature, row_max, cut_key, num_ties, z_kept, min_ratio,
              BLOCK_V: tl.constexpr):
    """Sum of ``exp(scaled - row_max)`` over the kept tokens (see :func:`sample_row`)."""
    total = tl.zeros([], tl.float32)
    ties_seen = tl.zeros([], tl.int32)
    for start in range(0, vocab_size, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        in_vocab = offs < vocab_size
        x = tl.load(row_ptr + offs, mask=in_vocab, other=float("-inf")).to(tl.float32) / temperature
        e = tl.exp(x - row_max)
        bits = x.to(tl.int32, bitcast=True)
        key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # order_key, inlined
        # keys above the cut, the first num_ties equal to it, and min-p (see sample_row)
        tie = in_vocab & (key == cut_key)
        rank = ties_seen + tl.cumsum(tie.to(tl.int32), axis=0) - 1
        keep = in_vocab & ((key > cut_key) | (tie & (rank < num_ties))) & (e / z_kept >= min_ratio)
        ties_seen += tl.sum(tie.to(tl.int32), axis=0)
        total += tl.sum(tl.where(keep, e, 0.0), axis=0)
    return total


@triton.jit
def race(row_ptr, noise_ptr, vocab_size, temperature, row_max, cut_key, num_ties, z_kept, min_ratio,
         z_final, BLOCK_V: tl.constexpr):
    """``argmax(probs / q)`` over the kept tokens (lowest index on ties)."""
    best_val = tl.full([], -1.0, tl.float32)
    best_idx = tl.zeros([], tl.int32)
    ties_seen = tl.zeros([], tl.int32)
    for start in range(0, vocab_size, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        in_vocab = offs < vocab_size
        x = tl.load(row_ptr + offs, mask=in_vocab, other=float("-inf")).to(tl.float32) / temperature
        e = tl.exp(x - row_max)
        bits = x.to(tl.int32, bitcast=True)
        key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # order_key, inlined
        # keys above the cut, the first num_ties equal to it, and min-p (see sample_row)
        tie = in_vocab & (key == cut_key)
        rank = ties_seen + tl.cumsum(tie.to(tl.int32), axis=0) - 1
        keep = in_vocab & ((key > cut_key) | (tie & (rank < num_ties))) & (e / z_kept >= min_ratio)
        ties_seen += tl.sum(tie.to(tl.int32), axis=0)
        q = tl.load(noise_ptr + offs, mask=in_vocab, other=1.0)
        score = tl.where(keep, (e / z_final) / q, -1.0)
        val, idx = tl.max(score, axis=0, return_indices=True)
        better = val > best_val
        best_idx = tl.where(better, start + idx, best_idx)
        best_val = tl.where(better, val, best_val)
    return best_idx


@triton.jit
def sample_row(row_ptr, noise_ptr, vocab_size, temperature, max_logit, top_k, top_p, min_p,
               USE_TOP_K: tl.constexpr, USE_TOP_P: tl.constexpr, USE_MIN_P: tl.constexpr,
               BLOCK_V: tl.constexpr):
    """Temperature, then top-k, top-p, min-p, then the race, for one row.

    The kept set is always "keys above ``cut_key``, plus the first ``num_ties`` equal to it":
    top-k keeps every tie at the k-th value; top-p keeps ties at its cut in index order while
    the mass before each stays below ``top_p`` (a stable descending sort's order)."""
    row_max = max_logit / temperature  # division by t > 0 is monotone, rounding included
    cut_key = tl.full([], INT32_MIN, tl.int64)
    num_ties = tl.full([], INT32_MAX, tl.int32)
    if USE_TOP_K:
        if (top_k > 0) & (top_k < vocab_size):
            cut_key = top_k_key(row_ptr, vocab_size, temperature, top_k, BLOCK_V)
    no_min = tl.zeros([], tl.float32)
    z_kept = mass_above(row_ptr, vocab_size, temperature, row_max, cut_key, False, BLOCK_V)
    if USE_TOP_P:
        if top_p < 1.0:
            target = top_p * z_kept
            cut_key = top_p_key(row_ptr, vocab_size, temperature, row_max, cut_key, target, BLOCK_V)
            cut_key = tl.minimum(cut_key, order_key(row_max).to(tl.int64))  # the top token stays
            above = mass_above(row_ptr, vocab_size, temperature, row_max, cut_key, True, BLOCK_V)
            e_cut = tl.exp(key_value(cut_key) - row_max)
            ties = tl.where(e_cut > 0.0, tl.ceil((target - above) / e_cut), 2.0e9)
            num_ties = tl.maximum(tl.minimum(ties, 2.0e9), 1.0).to(tl.int32)
            z_kept = kept_mass(row_ptr, vocab_size, temperature, row_max, cut_key, num_ties, z_kept,
                               no_min, BLOCK_V)
    min_ratio = no_min
    z_final = z_kept
    if USE_MIN_P:
        if min_p > 0.0:
            min_ratio = min_p * (1.0 / z_kept)
            z_final = kept_mass(row_ptr, vocab_size, temperature, row_max, cut_key, num_ties, z_kept,
                                min_ratio, BLOCK_V)
    return race(row_ptr, noise_ptr, vocab_size, temperature, row_max, cut_key, num_ties, z_kept,
                min_ratio, z_final, BLOCK_V)


@triton.jit
def sample_kernel(
    out_ptr, logits_ptr, noise_ptr, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr,
    stride_logits, stride_noise, vocab_size,
    ALL_GREEDY: tl.constexpr, USE_TOP_K: tl.constexpr, USE_TOP_P: tl.constexpr,
    USE_MIN_P: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """One token id per row: greedy where temperature is 0, else a filtered exponential race."""
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_logits
    max_logit, token = row_argmax(row_ptr, vocab_size, BLOCK_V)
    if not ALL_GREEDY:
        temperature = tl.load(temperature_ptr + row)
        if temperature > 0.0:
            token = sample_row(
                row_ptr, noise_ptr + row * stride_noise, vocab_size, temperature, max_logit,
                tl.load(top_k_ptr + row), tl.load(top_p_ptr + row), tl.load(min_p_ptr + row),
                USE_TOP_K, USE_TOP_P, USE_MIN_P, BLOCK_V,
            )
    tl.store(out_ptr + row, token.to(tl.int64))
