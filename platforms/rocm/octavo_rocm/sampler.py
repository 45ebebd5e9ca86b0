"""The rocm sampler: a split-vocabulary kernel for the common unfiltered case.

An MI300X has 304 compute units; one program per row leaves most of them idle for a decode
batch of a few dozen rows over a 128k-256k vocabulary. When no row of the batch uses top-k,
top-p or min-p (what most serving traffic asks for), the greedy argmax and the exponential race
split the vocabulary across ``splits`` programs per row, each reducing its slice to a candidate,
and a second launch picks each row's winner: no sort, no host sync. The race compares
``logit / T - log(q)``, the logarithm of ``softmax(logit / T) / q`` up to a per-row constant, so
slices need no shared maximum or normaliser. Batches with filters use the shared sort-free
kernel (``octavo_triton.sampler``) with wave64 chunks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from octavo.platform.types import SamplingMetadata
from octavo_triton.runtime import interpreting, next_power_of_2
from octavo_triton.sampler import exponential_noise
from octavo_triton.sampler import make_sampler as make_filtering_sampler
from octavo_triton.tuning import SamplerTuning


@triton.jit
def split_candidates_kernel(
    greedy_val_ptr,
    greedy_idx_ptr,
    race_val_ptr,
    race_idx_ptr,
    logits_ptr,
    noise_ptr,
    temperature_ptr,
    stride_logits,
    stride_noise,
    vocab_size,
    split_size,
    ALL_GREEDY: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Grid ``(R, splits)``: the best greedy and race candidate of one vocabulary slice."""
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    num_splits = tl.num_programs(1)
    begin = split * split_size
    end = tl.minimum(begin + split_size, vocab_size)
    temperature = tl.load(temperature_ptr + row)
    t = tl.where(temperature > 0.0, temperature, 1.0)
    greedy_val = tl.full([], float("-inf"), tl.float32)
    greedy_idx = begin
    race_val = tl.full([], float("-inf"), tl.float32)
    race_idx = begin
    for start in range(begin, end, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        mask = offs < end
        x = tl.load(logits_ptr + row * stride_logits + offs, mask=mask, other=float("-inf"))
        val, idx = tl.max(x, axis=0, return_indices=True)
        better = val > greedy_val
        greedy_idx = tl.where(better, start + idx, greedy_idx)
        greedy_val = tl.where(better, val, greedy_val)
        if not ALL_GREEDY:
            q = tl.load(noise_ptr + row * stride_noise + offs, mask=mask, other=1.0)
            score = tl.where(mask, x / t - tl.log(q), float("-inf"))
            val, idx = tl.max(score, axis=0, return_indices=True)
            better = val > race_val
            race_idx = tl.where(better, start + idx, race_idx)
            race_val = tl.where(better, val, race_val)
    slot = row * num_splits + split
    tl.store(greedy_val_ptr + slot, greedy_val)
    tl.store(greedy_idx_ptr + slot, greedy_idx)
    tl.store(race_val_ptr + slot, race_val)
    tl.store(race_idx_ptr + slot, race_idx)


@triton.jit
def pick_winner_kernel(
    out_ptr,
    greedy_val_ptr,
    greedy_idx_ptr,
    race_val_ptr,
    race_idx_ptr,
    temperature_ptr,
    num_splits,
    SPLITS_PAD: tl.constexpr,
):
    """Grid ``(R,)``: the row's token from its slices' candidates (earliest slice on ties)."""
    row = tl.program_id(0).to(tl.int64)
    splits = tl.arange(0, SPLITS_PAD)
    mask = splits < num_splits
    base = row * num_splits + splits
    greedy_val = tl.load(greedy_val_ptr + base, mask=mask, other=float("-inf"))
    race_val = tl.load(race_val_ptr + base, mask=mask, other=float("-inf"))
    _, greedy_split = tl.max(greedy_val, axis=0, return_indices=True)
    _, race_split = tl.max(race_val, axis=0, return_indices=True)
    greedy = tl.load(greedy_idx_ptr + row * num_splits + greedy_split)
    drawn = tl.load(race_idx_ptr + row * num_splits + race_split)
    temperature = tl.load(temperature_ptr + row)
    tl.store(out_ptr + row, tl.where(temperature > 0.0, drawn, greedy).to(tl.int64))


def make_sampler(
    vocab_size: int, tuning: SamplerTuning, min_split: int = 8192, max_splits: int = 64
):
    """Return ``fn(logits [R, V], metadata) -> token ids [R] int64`` (the hook's contract):
    split-vocabulary for unfiltered batches, the shared filtering kernel otherwise."""
    filtering = make_filtering_sampler(vocab_size, tuning)
    launch = {} if interpreting() else {"num_warps": tuning.num_warps}

    def sample(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Greedy where temperature is 0, else an exponential race over softmax(logits / T)."""
        if not (metadata.no_top_k and metadata.no_top_p and metadata.no_min_p):
            return filtering(logits, metadata)
        logits = logits.float()
        if logits.stride(-1) != 1:
            logits = logits.contiguous()
        num_rows, vocab = logits.shape
        out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
        if num_rows == 0:
            return out
        splits = max(1, min(max_splits, triton.cdiv(vocab, min_split)))
        split_size = triton.cdiv(vocab, splits)
        noise = logits if metadata.all_greedy else exponential_noise(logits, metadata)
        temperature = metadata.temperature.to(device=logits.device, dtype=torch.float32)
        vals = torch.empty(2, num_rows, splits, dtype=torch.float32, device=logits.device)
        idxs = torch.empty(2, num_rows, splits, dtype=torch.int32, device=logits.device)
        split_candidates_kernel[(num_rows, splits)](
            vals[0],
            idxs[0],
            vals[1],
            idxs[1],
            logits,
            noise,
            temperature,
            logits.stride(0),
            noise.stride(0),
            vocab,
            split_size,
            ALL_GREEDY=metadata.all_greedy,
            BLOCK_V=min(tuning.block_v, next_power_of_2(split_size)),
            **launch,
        )
        pick_winner_kernel[(num_rows,)](
            out,
            vals[0],
            idxs[0],
            vals[1],
            idxs[1],
            temperature,
            splits,
            SPLITS_PAD=max(2, next_power_of_2(splits)),
        )
        return out

    return sample
