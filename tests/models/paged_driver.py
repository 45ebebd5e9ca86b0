"""A minimal stand-in for the scheduler: drives a ModelRunner with hand-built SchedulerOutputs.

It allocates blocks from a shuffled free list (so block tables are never contiguous), schedules
every active request each step (whole remaining prompt, or chunks of ``chunk_size``), and can
preempt (recompute or swap), copy-on-write a request's last block, and scribble over freed
blocks so that a runner still reading them produces wrong tokens.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Optional

import torch

from octavo.kv_cache.transfers import BlockTransfer, TransferKind
from octavo.model_executor.model_runner import ModelRunner
from octavo.model_executor.runner_output import ModelRunnerOutput
from octavo.sampling_params import SamplingParams
from octavo.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

GREEDY = SamplingParams(temperature=0.0)


class BlockAllocator:
    """Block ids from a shuffled free list."""

    def __init__(self, num_blocks: int, seed: int = 0):
        self.free_ids = list(range(num_blocks))
        random.Random(seed).shuffle(self.free_ids)

    def allocate(self, n: int) -> list[int]:
        assert n <= len(self.free_ids), "test driver ran out of KV blocks"
        taken, self.free_ids = self.free_ids[:n], self.free_ids[n:]
        return taken

    def free(self, block_ids: list[int]) -> None:
        self.free_ids = list(block_ids) + self.free_ids  # reused first: stale data gets overwritten


@dataclasses.dataclass
class DriverRequest:
    req_id: str
    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    arrival: int = 0
    output: list[int] = dataclasses.field(default_factory=list)
    block_ids: list[int] = dataclasses.field(default_factory=list)
    host_block_ids: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0
    seen: bool = False
    finished: bool = False
    swapped_out: bool = False
    sent_blocks: int = 0
    table_start: Optional[int] = None
    resumed: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)


class Driver:
    """Runs requests to completion on ``runner``; ``outputs()`` gives their tokens."""

    def __init__(
        self, runner: ModelRunner, num_blocks: int, num_host_blocks: int = 0, seed: int = 0
    ):
        self.runner = runner
        self.block_size = runner.block_size
        self.device_blocks = BlockAllocator(num_blocks, seed)
        self.host_blocks = BlockAllocator(num_host_blocks, seed + 1)
        runner.initialize_kv_cache(num_blocks, num_host_blocks)
        self.requests: list[DriverRequest] = []
        self.step_index = 0
        self.finished_ids: set[str] = set()
        self.pending_transfers: list[BlockTransfer] = []
        self.last_output: Optional[ModelRunnerOutput] = None

    def add(
        self, prompt: list[int], max_tokens: int, params: SamplingParams = GREEDY, arrival: int = 0
    ) -> DriverRequest:
        req = DriverRequest(f"req-{len(self.requests)}", list(prompt), params, max_tokens, arrival)
        self.requests.append(req)
        return req

    def active(self) -> list[DriverRequest]:
        return [r for r in self.requests if not r.finished and r.arrival <= self.step_index]

    # --- one step ----------------------------------------------------------------------------

    def step(
        self, chunk_size: Optional[int] = None, skip: tuple[str, ...] = ()
    ) -> ModelRunnerOutput:
        new, cached, scheduled = [], [], {}
        for req in self.active():
            if req.req_id in skip or req.swapped_out:
                continue
            n = req.num_tokens - req.num_computed
            n = min(n, chunk_size) if chunk_size else n
            need = -(-(req.num_computed + n) // self.block_size) - len(req.block_ids)
            req.block_ids += self.device_blocks.allocate(max(need, 0))
            if not req.seen:
                new.append(
                    NewRequestData(
                        req.req_id, req.prompt, req.params, list(req.block_ids), req.num_computed
                    )
                )
                req.seen = True
            else:
                start = req.table_start if req.table_start is not None else req.sent_blocks
                cached.append(
                    CachedRequestData(
                        req.req_id,
                        req.block_ids[start:],
                        req.num_computed,
                        resumed_from_preemption=req.resumed,
                        block_table_start=req.table_start,
                    )
                )
            req.sent_blocks, req.table_start, req.resumed = len(req.block_ids), None, False
            scheduled[req.req_id] = n
        output = SchedulerOutput(
            new,
            cached,
            scheduled,
            sum(scheduled.values()),
            finished_req_ids=self.finished_ids,
            kv_transfers=tuple(self.pending_transfers),
        )
        self.finished_ids, self.pending_transfers = set(), []
        result = self.runner.execute_model(output)
        self._apply(result, scheduled)
        self.step_index += 1
        self.last_output = result
        return result

    def _apply(self, result: ModelRunnerOutput, scheduled: dict[str, int]) -> None:
        assert sorted(result.req_ids) == sorted(scheduled)
        for req in self.requests:
            if req.req_id not in scheduled:
                continue
            req.num_computed += scheduled[req.req_id]
            tokens = result.sampled_token_ids[result.req_ids.index(req.req_id)]
            assert len(tokens) == (1 if req.num_computed == req.num_tokens else 0)
            req.output += tokens
            if len(req.output) >= req.max_tokens:
                req.finished = True
                self.finished_ids.add(req.req_id)
                self.device_blocks.free(req.block_ids)

    def run(self, chunk_size: Optional[int] = None, max_steps: int = 10_000) -> list[list[int]]:
        while any(not r.finished for r in self.requests):
            assert self.step_index < max_steps
            self.step(chunk_size)
        if self.finished_ids:
            self.step()  # tell the runner about the last finished requests
        return self.outputs()

    def outputs(self) -> list[list[int]]:
        return [r.output for r in self.requests]

    # --- memory events -----------------------------------------------------------------------

    def scribble(self, block_ids: list[int]) -> None:
        """Overwrite blocks in every layer's cache with a constant, as reuse by another request
        would."""
        index = torch.tensor(block_ids, dtype=torch.int64)
        for layer, cache in zip(self.runner.attention_layers, self.runner.kv_caches):
            cache.index_fill_(layer.backend.block_dim, index, 7.0)

    def preempt_recompute(self, req: DriverRequest) -> None:
        """Drop the request's KV; it is recomputed from scratch when next scheduled."""
        self.device_blocks.free(req.block_ids)
        self.scribble(req.block_ids)
        req.block_ids, req.num_computed, req.resumed, req.table_start = [], 0, True, 0

    def preempt_swap(self, req: DriverRequest) -> None:
        """Move the request's blocks to host memory (done at the start of the next step)."""
        req.host_block_ids = self.host_blocks.allocate(len(req.block_ids))
        self.pending_transfers.append(
            BlockTransfer(TransferKind.SWAP_OUT, tuple(req.block_ids), tuple(req.host_block_ids))
        )
        self.device_blocks.free(req.block_ids)
        req.block_ids, req.swapped_out = [], True

    def swap_in(self, req: DriverRequest) -> None:
        """Bring a swapped-out request back into fresh device blocks."""
        req.block_ids = self.device_blocks.allocate(len(req.host_block_ids))
        self.pending_transfers.append(
            BlockTransfer(TransferKind.SWAP_IN, tuple(req.host_block_ids), tuple(req.block_ids))
        )
        self.host_blocks.free(req.host_block_ids)
        req.swapped_out, req.resumed, req.table_start = False, True, 0

    def copy_on_write_last_block(self, req: DriverRequest) -> int:
        """Give the request a copy of its last block (copied before the next step); returns the
        old block, which the test may then scribble over."""
        old = req.block_ids[-1]
        (copy,) = self.device_blocks.allocate(1)
        self.pending_transfers.append(BlockTransfer(TransferKind.COPY, (old,), (copy,)))
        req.block_ids[-1] = copy
        req.table_start = len(req.block_ids) - 1
        return old
