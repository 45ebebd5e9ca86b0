"""How many compute threads each step of the cpu platform runs on.

A step's GEMMs and attention are OpenMP parallel regions, a few dozen per step. A region on two
threads pays for waking the other thread (it sleeps between regions: OMP_WAIT_POLICY=PASSIVE),
and waits for it whenever anything else holds that core: the server's event loop, which
detokenises and streams every token, or a benchmark client. A small step does too little work
for its second thread to earn that back, so steps of fewer than ``serial_tokens`` tokens run on
one thread and leave the other core to the rest of the process; larger steps (prefill, large
decode batches) run on all of them. Serving the tiny model on 2 cores (BENCHMARKS.md): at
concurrency 1 one thread made 145-158 output tok/s against 112-125 on two, at concurrency 4 one
thread was faster too, at 8 two threads were (771 against 640 tok/s), at 32 the two were alike.
A small oneDNN GEMM on two sleeping threads costs ~3x its one-thread time; spinning threads
(OMP_WAIT_POLICY=ACTIVE) win that back on the main thread only, not on the server's engine
thread (benchmarks/engine_thread_gemm.py).
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
