"""How many compute threads each step of the cpu platform runs on.

A step's compiled kernels (GEMMs, attention, norms; a few dozen per step) share their work
between the calling thread and helpers of their own pool (csrc/work_sharing.h), which spin for
200 us after a kernel and then sleep; the caller never waits for a helper that has not joined.
torch's own ops run on OpenMP threads that sleep between regions (OMP_WAIT_POLICY=PASSIVE).
Steps of fewer than ``serial_tokens`` tokens run on one thread and leave the other cores to the
rest of the process (the server's event loop, which detokenises and streams every token, a
benchmark client); larger steps run on all of them. The default runs every step on all threads
(``serial_tokens`` 0): measured on 2 cores (Zen 1, BENCHMARKS.md, issue 16 eighteenth part) once
the decoder stack had taken the interpreter out of a small step, two threads made batch-1
decoding of the demo model 355 against 318 tok/s offline, speculative batch-1 steps of 5 tokens
x1.2-1.3 faster (P-EAGLE 321 against 252 tok/s), and serving one stream of the tiny model 245-260
against 230-238 output tok/s (ITL p50 3.4-3.6 against 3.8-3.9 ms) with concurrency 8 within noise
(1,152-1,160 against 1,171-1,227). Before the stack (thirteenth part) one thread served one
stream as fast at less CPU, and the cut was 8 tokens.
``OCTAVO_CPU_SERIAL_TOKENS=N`` sets the cut (0: always every thread).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch

SERIAL_TOKENS_ENV = "OCTAVO_CPU_SERIAL_TOKENS"
DEFAULT_SERIAL_TOKENS = 0


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
            return (
                f"{self.max_threads} compute thread(s) for every step "
                f"({SERIAL_TOKENS_ENV}=N: one for steps under N tokens)"
            )
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
