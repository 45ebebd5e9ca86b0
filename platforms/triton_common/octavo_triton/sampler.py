"""The batched sampler built on :func:`sampler_kernels.sample_kernel`."""

from __future__ import annotations

import torch
import triton

from octavo.platform.types import SamplingMetadata
from octavo_triton.runtime import interpreting, next_power_of_2
from octavo_triton.sampler_kernels import sample_kernel
from octavo_triton.tuning import SamplerTuning


def exponential_noise(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Exp(1) noise ``[R, V]`` on the logits' device; a row with a seeded generator draws from
    it alone (the global generator fills the rest first), as the reference sampler does, so a
    seeded request gets the same tokens on every platform and in any batch."""
    q = torch.empty(logits.shape, dtype=torch.float32, device=logits.device).exponential_()
    for row, generator in metadata.generators.items():
        q[row].exponential_(generator=generator)
    return q


def make_sampler(vocab_size: int, tuning: SamplerTuning = SamplerTuning()):
    """Return ``fn(logits [R, V], metadata) -> token ids [R] int64`` (the hook's contract)."""
    interpret = interpreting()
    launch = {} if interpret else {"num_warps": tuning.num_warps}

    def sample(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Greedy where temperature is 0; else temperature, top-k, top-p, min-p and the
        exponential race, as ``octavo.ops.reference.sample``."""
        logits = logits.float()
        if logits.stride(-1) != 1:
            logits = logits.contiguous()
        num_rows, vocab = logits.shape
        out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
        if num_rows == 0:
            return out
        noise = logits if metadata.all_greedy else exponential_noise(logits, metadata)
        device = logits.device
        block_v = min(tuning.block_v, next_power_of_2(max(16, vocab)))
        block_r = tuning.interpreter_block_r if interpret else tuning.block_r
        block_r = min(block_r, next_power_of_2(num_rows))
        sample_kernel[(triton.cdiv(num_rows, block_r),)](
            out,
            logits,
            noise,
            metadata.temperature.to(device=device, dtype=torch.float32),
            metadata.top_k.to(device=device, dtype=torch.int32),
            metadata.top_p.to(device=device, dtype=torch.float32),
            metadata.min_p.to(device=device, dtype=torch.float32),
            num_rows,
            logits.stride(0),
            noise.stride(0),
            vocab,
            ALL_GREEDY=metadata.all_greedy,
            USE_TOP_K=not metadata.no_top_k,
            USE_TOP_P=not metadata.no_top_p,
            USE_MIN_P=not metadata.no_min_p,
            BLOCK_R=block_r,
            BLOCK_V=block_v,
            **launch,
        )
        return out

    return sample
