"""How many compute threads each step of the cpu platform runs on.

A step's compiled kernels (GEMMs, attention, norms; a few dozen per step) share their work
between the calling thread and helpers of their own pool (csrc/work_sharing.h), which spin for
200 us after a kernel and then sleep; the caller never waits for a helper that has not joined.
torch's own ops run on OpenMP threads that sleep between regions (OMP_WAIT_POLICY=PASSIVE). A
small step does too little work for a second thread to earn back what it costs: the server's
event loop, which detokenises and streams every token, and a benchmark client want that core.
So steps of fewer than ``serial_tokens`` tokens run on one thread and leave the other core to
the rest of the process; larger steps (prefill, large decode batches) run on all of them.
Measured on 2 cores with the pool (BENCHMARKS.md, issue 16 thirteenth part): a batch-1 decode
of the tiny model offline took 1.6-2.4 ms a token on two threads against 2.2-3.1 on one, but
serving one stream made the same (285-338 against 296-342 output tok/s) at 1.5x the server's
CPU, and batch-1 speculative decoding (steps of 5 tokens) came out mixed (P-EAGLE 414 against
380 tok/s, Gumiho 353 against 411; one run each); the cut stays at 8. With OpenMP's regions
instead (before the pool), one thread made 145-158 output tok/s at concurrency 1 against
112-125 on two.
``OCTAVO_CPU_SERIAL_TOKENS`` sets the cut (0: always every thread).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch

SERIAL_TOKENS_ENV = "OCTAVO_CPU_SERIAL_TOKENS"
DEFAULT_SERIAL_TOKENS = 8


@dataclasses.dataclass(frozen=True)
class StepThreads:
    """Threads for a step of ``num_tokens`` tokens: one below ``serial_tokens``, else
    ``max_threads``."""

    max_threads: int
    serial_tokens: int

    @classmethod
    def from_env(cls) -> "StepThreads":
        raw = os.environ.get(SERIAL_TOKENS_ENV, str(DEFAULT_SERIAL_TOKENS)).strip()
        try:
            serial_tokens = int(raw)
        except ValueError:
            serial_tokens = -1
        if serial_tokens < 0:
            raise ValueError(
                f"{SERIAL_TOKENS_ENV}={raw!r}: give a token count >= 0 (steps with fewer tokens "
                f"run on one thread; 0 runs every step on all {torch.get_num_threads()} threads)"
            )
        return cls(max_threads=torch.get_num_threads(), serial_tokens=serial_tokens)

    def for_tokens(self, num_tokens: int) -> int:
        return 1 if num_tokens < self.serial_tokens else self.max_threads

    def describe(self) -> str:
        if self.max_threads == 1 or self.serial_tokens == 0:
            return f"{self.max_threads} compute thread(s) for every step"
        return (
            f"{self.max_threads} compute threads, 1 for steps under {self.serial_tokens} tokens "
            f"({SERIAL_TOKENS_ENV})"
        )


class ThreadedForward:
    """The model's forward, each step on the threads its size pays for (the thread count stays
    set for the step's logits and sampling, which follow the forward)."""

    def __init__(self, model: Any, threads: StepThreads):
        self.model = model  # the model, or its compiled forward
        self.threads = threads
        self.compiled = getattr(model, "compiled", False)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: Any):
        wanted = self.threads.for_tokens(input_ids.shape[0])
        if wanted != torch.get_num_threads():  # per calling thread: serving steps in its own
            torch.set_num_threads(wanted)
        return self.model(input_ids, positions, metadata)
