"""Start-up steps on a scratch KV cache: the profile run (the activation peak of a max-size step,
for KV cache sizing) and the warm-up of a compiled forward."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import TYPE_CHECKING, Optional

import numpy as np
import torch

from octavo.model_executor.memory import PeakMemory
from octavo.sampling_params import SamplingParams
from octavo.sched.output import NewRequestData, SchedulerOutput

if TYPE_CHECKING:
    from octavo.model_executor.model_runner import ModelRunner


@dataclasses.dataclass(frozen=True)
class ProfileResult:
    """What the start-up profile run measured: the activation peak of a max-size step."""

    peak_activation_bytes: int
    num_tokens: int
    num_reqs: int


def profile_run(runner: "ModelRunner") -> ProfileResult:
    """Run one max-size step (``max_num_batched_tokens`` prompt tokens over up to
    ``max_num_seqs`` requests, all sampling) on a scratch KV cache and report its peak
    activation memory, for sizing the real KV cache. Leaves no request behind."""
    cfg = runner.config
    num_reqs = min(cfg.max_num_seqs, cfg.max_num_batched_tokens)
    base, extra = divmod(cfg.max_num_batched_tokens, num_reqs)
    lengths = [min(base + (i < extra), runner.model_config.max_model_len) for i in range(num_reqs)]
    params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, min_p=0.01, seed=0)
    peak = PeakMemory(runner.device)
    scratch_step(runner, lengths, params, measure=peak)
    return ProfileResult(peak.bytes, sum(lengths), num_reqs)


WARM_UP_STEPS = ((1, 1), (1,), (32, 32))
"""The prompt lengths of the warm-up steps: two requests of one token (a small step), one request
of one token (a single-token step, which a compiled graph may specialise on), and a 64-token
step (a large one, on all threads where a platform runs small steps on fewer)."""


def warm_up(runner: "ModelRunner") -> None:
    """Run the :data:`WARM_UP_STEPS` on a scratch KV cache, so that a compiled forward builds
    (or loads from its cache) the graphs of small and large steps at start-up instead of at the
    first requests. Leaves no request behind."""
    params = SamplingParams(temperature=0.0)
    for lengths in WARM_UP_STEPS:
        scratch_step(runner, list(lengths), params)


def scratch_step(
    runner: "ModelRunner",
    lengths: list[int],
    params: SamplingParams,
    measure: Optional[PeakMemory] = None,
) -> None:
    """Run one step of new requests with prompts of ``lengths`` tokens (zeros), each sampling
    one token with ``params``, on a scratch KV cache of just their blocks (``measure``, if
    given, around the step alone); then forget them and bind the runner's own caches again."""
    bs = runner.block_size
    num_blocks = [-(-n // bs) for n in lengths]
    starts = np.concatenate([[0], np.cumsum(num_blocks)]).tolist()
    new_reqs = [
        NewRequestData(f"__scratch_{i}", [0] * n, params, list(range(starts[i], starts[i + 1])), 0)
        for i, n in enumerate(lengths)
    ]
    saved = runner.kv_caches
    dtype = runner.model_config.dtype
    scratch = [
        torch.zeros(layer.backend.kv_cache_shape(starts[-1]), dtype=dtype, device=runner.device)
        for layer in runner.attention_layers
    ]
    runner._bind(scratch)
    step = SchedulerOutput(
        new_reqs, [], {r.req_id: len(r.prompt_token_ids) for r in new_reqs}, sum(lengths)
    )
    try:
        with measure if measure is not None else contextlib.nullcontext():
            runner.execute_model(step)
    finally:
        runner.execute_model(
            SchedulerOutput([], [], {}, 0, finished_req_ids={r.req_id for r in new_reqs})
        )
        runner.kv_caches = saved
        runner._bind(saved)
