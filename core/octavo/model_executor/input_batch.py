"""The runner's persistent batch: one row per running request, updated in place from deltas.

Rows hold token ids, the block table and sampling parameters as host arrays, so a step's flat
inputs are gathered with array operations. Removing a request leaves a hole; ``condense``
moves rows from the tail into holes, keeping rows ``0 .. num_reqs-1`` dense.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

import numpy as np
import torch

from octavo.lora.request import LoRARequest
from octavo.model_executor.step_inputs import ragged_index
from octavo.platform.types import SamplingMetadata
from octavo.sampling_params import SamplingParams, needs_processing
from octavo.sched.output import NewRequestData


@dataclasses.dataclass(slots=True)
class CachedRequestState:
    """The runner's copy of one request (kept while the request is idle or preempted)."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    generator: Optional[torch.Generator]
    lora_request: Optional[LoRARequest] = None

    @classmethod
    def from_new(cls, new: NewRequestData, device: torch.device) -> "CachedRequestState":
        generator = None
        if new.sampling_params.seed is not None:
            generator = torch.Generator(device=device).manual_seed(new.sampling_params.seed)
        return cls(
            new.req_id,
            list(new.prompt_token_ids),
            list(new.output_token_ids),
            new.sampling_params,
            list(new.block_ids),
            new.num_computed_tokens,
            generator,
            new.lora_request,
        )

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


def _host_buffer(shape, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, pin_memory=pin)


class InputBatch:
    """Per-request rows of token ids, block table and sampling parameters."""

    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        max_num_blocks_per_req: int,
        vocab_size: int,
        device: Union[str, torch.device],
        pin_memory: bool = False,
    ):
        """``pin_memory`` (the platform's ``Capabilities.pin_host_memory``) page-locks the
        host staging buffers a step's sampling parameters are copied from."""
        self.max_num_reqs, self.max_model_len = max_num_reqs, max_model_len
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.req_ids: list[Optional[str]] = []
        self.req_id_to_index: dict[str, int] = {}
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int32)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.block_table = np.zeros((max_num_reqs, max_num_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int32)
        self.temperature = np.zeros(max_num_reqs, dtype=np.float32)
        self.top_k = np.zeros(max_num_reqs, dtype=np.int32)
        self.top_p = np.ones(max_num_reqs, dtype=np.float32)
        self.min_p = np.zeros(max_num_reqs, dtype=np.float32)
        self.num_logprobs = np.full(max_num_reqs, -1, dtype=np.int32)
        self.adjusts_logits = np.zeros(max_num_reqs, dtype=bool)  # penalties, bias, min_tokens
        self.constrained = np.zeros(max_num_reqs, dtype=bool)  # structured output
        self.lora_ids = np.zeros(max_num_reqs, dtype=np.int64)  # 0: the base model
        self.generators: dict[int, torch.Generator] = {}
        # Bumped whenever a row's sampling parameters may change (a request added, removed or
        # moved): the last sampling_metadata is reused while it and the rows asked for stand.
        self._sampling_version = 0
        self._last_metadata: Optional[tuple[int, bytes, SamplingMetadata]] = None
        self._per_row = (
            self.num_tokens,
            self.num_prompt_tokens,
            self.num_computed_tokens,
            self.num_blocks,
            self.temperature,
            self.top_k,
            self.top_p,
            self.min_p,
            self.num_logprobs,
            self.adjusts_logits,
            self.constrained,
            self.lora_ids,
        )
        # staging buffers for one step's sampling rows
        self._sampling_cpu = {
            name: (buffer, buffer.numpy())
            for name, buffer in (
                (name, _host_buffer(max_num_reqs, dtype, pin_memory))
                for name, dtype in (
                    ("temperature", torch.float32),
                    ("top_k", torch.int32),
                    ("top_p", torch.float32),
                    ("min_p", torch.float32),
                )
            )
        }

    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_index)

    # --- membership ------------------------------------------------------------------------------

    def add_request(self, state: CachedRequestState) -> int:
        """Fill a free row (the first hole, else a new row at the end) from ``state``."""
        assert state.req_id not in self.req_id_to_index
        holes = [i for i, r in enumerate(self.req_ids) if r is None]
        row = holes[0] if holes else len(self.req_ids)
        if row == self.max_num_reqs:
            raise RuntimeError(
                f"more than max_num_seqs={self.max_num_reqs} requests scheduled at once"
            )
        if row == len(self.req_ids):
            self.req_ids.append(None)
        self.req_ids[row] = state.req_id
        self.req_id_to_index[state.req_id] = row
        num_prompt = len(state.prompt_token_ids)
        self.num_tokens[row] = 0
        self.num_prompt_tokens[row] = num_prompt
        self.append_token_ids(row, state.prompt_token_ids)
        self.append_token_ids(row, state.output_token_ids)
        self.num_computed_tokens[row] = state.num_computed_tokens
        self.set_block_ids(row, state.block_ids)
        params = state.sampling_params
        self._sampling_version += 1
        self.temperature[row] = params.temperature
        self.top_k[row] = params.top_k
        self.top_p[row] = params.top_p
        self.min_p[row] = params.min_p
        self.num_logprobs[row] = -1 if params.logprobs is None else params.logprobs
        self.adjusts_logits[row] = needs_processing(params)
        self.constrained[row] = params.structured_outputs is not None
        lora = state.lora_request
        self.lora_ids[row] = 0 if lora is None else lora.lora_int_id
        if state.generator is not None:
            self.generators[row] = state.generator
        return row

    def remove_request(self, req_id: str) -> None:
        """Free the request's row (leaving a hole until ``condense``); unknown ids are ignored."""
        row = self.req_id_to_index.pop(req_id, None)
        if row is not None:
            self._sampling_version += 1
            self.req_ids[row] = None
            self.generators.pop(row, None)

    def condense(self) -> None:
        """Move tail rows into holes so that rows ``0 .. num_reqs-1`` are all occupied."""
        while self.req_ids and self.req_ids[-1] is None:
            self.req_ids.pop()
        holes = [i for i, r in enumerate(self.req_ids) if r is None]
        for hole in holes:
            while self.req_ids and self.req_ids[-1] is None:
                self.req_ids.pop()
            if hole >= len(self.req_ids):
                break
            self._move_row(len(self.req_ids) - 1, hole)
            self.req_ids.pop()
        assert len(self.req_ids) == self.num_reqs

    def _move_row(self, src: int, dst: int) -> None:
        self._sampling_version += 1
        req_id = self.req_ids[src]
        self.req_ids[dst], self.req_id_to_index[req_id] = req_id, dst
        n, b = self.num_tokens[src], self.num_blocks[src]
        self.token_ids[dst, :n] = self.token_ids[src, :n]
        self.block_table[dst, :b] = self.block_table[src, :b]
        for array in self._per_row:
            array[dst] = array[src]
        generator = self.generators.pop(src, None)
        if generator is not None:
            self.generators[dst] = generator

    # --- in-place updates ------------------------------------------------------------------------

    def append_token_ids(self, row: int, token_ids: list[int]) -> None:
        start = int(self.num_tokens[row])
        end = start + len(token_ids)
        if end > self.max_model_len:
            raise ValueError(
                f"request {self.req_ids[row]!r} would hold {end} tokens, "
                f"over max_model_len={self.max_model_len}"
            )
        self.token_ids[row, start:end] = token_ids
        self.num_tokens[row] = end

    def set_block_ids(self, row: int, block_ids: list[int]) -> None:
        self.num_blocks[row] = 0
        self.append_block_ids(row, block_ids)

    def append_block_ids(self, row: int, block_ids: list[int]) -> None:
        start = int(self.num_blocks[row])
        end = start + len(block_ids)
        if end > self.block_table.shape[1]:
            raise ValueError(
                f"request {self.req_ids[row]!r} would hold {end} blocks, "
                f"over the per-request maximum {self.block_table.shape[1]}"
            )
        self.block_table[row, start:end] = block_ids
        self.num_blocks[row] = end

    def append_sampled(self, rows: np.ndarray, tokens: np.ndarray) -> list[list[int]]:
        """Append each row's sampled tokens (``[S, W]``, -1 padded; past ``max_model_len`` they
        are dropped); returns them, a list per row."""
        if tokens.shape[1] == 1:  # no drafts: one token per row
            fits = self.num_tokens[rows] < self.max_model_len
            self.token_ids[rows[fits], self.num_tokens[rows[fits]]] = tokens[fits, 0]
            self.num_tokens[rows[fits]] += 1
            return [[token] for token in tokens[:, 0].tolist()]
        counts = (tokens >= 0).sum(axis=1)
        row, offset = ragged_index(counts)
        columns = self.num_tokens[rows[row]] + offset
        fits = columns < self.max_model_len
        self.token_ids[rows[row][fits], columns[fits]] = tokens[tokens >= 0][fits]
        self.num_tokens[rows] = np.minimum(self.num_tokens[rows] + counts, self.max_model_len)
        return [[t for t in row_tokens if t >= 0] for row_tokens in tokens.tolist()]

    # --- sampling --------------------------------------------------------------------------------

    def sampling_metadata(self, rows: np.ndarray) -> SamplingMetadata:
        """Sampling tensors for the batch rows ``rows`` (in that order), on the device.

        The tensors are views of (or copies from) staging buffers that the next call with other
        rows overwrites; a call with the same rows and no request added, removed or moved since
        returns the same metadata (a decode step's ~0.1 ms at batch 1). Callers must not
        modify it."""
        key = rows.tobytes()
        last = self._last_metadata
        if last is not None and last[0] == self._sampling_version and last[1] == key:
            return last[2]
        metadata = self._stage_sampling_metadata(rows)
        self._last_metadata = (self._sampling_version, key, metadata)
        return metadata

    def _stage_sampling_metadata(self, rows: np.ndarray) -> SamplingMetadata:
        count = len(rows)
        # Usually every row samples: then rows are 0..count-1 and slices replace gathers.
        select = slice(0, count) if rows[-1] == count - 1 else rows
        staged = {}
        for name, (buffer, buffer_np) in self._sampling_cpu.items():
            buffer_np[:count] = getattr(self, name)[select]
            staged[name] = buffer[:count].to(self.device, non_blocking=True)
        temperature, top_k, top_p = self.temperature[select], self.top_k[select], self.top_p[select]
        generators = {}
        if self.generators:
            position = {int(row): i for i, row in enumerate(rows)}
            generators = {position[r]: g for r, g in self.generators.items() if r in position}
        return SamplingMetadata(
            temperature=staged["temperature"],
            top_k=staged["top_k"],
            top_p=staged["top_p"],
            min_p=staged["min_p"],
            generators=generators,
            all_greedy=not temperature.any(),
            all_random=bool(temperature.all()),
            no_top_k=bool(((top_k <= 0) | (top_k >= self.vocab_size)).all()),
            no_top_p=bool((top_p >= 1).all()),
            no_min_p=not self.min_p[select].any(),
        )
