"""The hardware-neutral half of a model runner: request states, the persistent batch, one step's
flat inputs, and what becomes of the sampled tokens.

Each step the scheduler's deltas are applied to the persistent :class:`InputBatch` and the flat
batch (``input_ids``, ``positions``, ``query_start_loc``, ``seq_lens``, ``block_table``,
``slot_mapping``) is gathered with array operations into persistent host-side buffers. The
torch :class:`~octavo.model_executor.model_runner.ModelRunner` and a platform's own runner (the
tpu platform's JAX runner) build on this and differ in how they run the model and sample.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol

import numpy as np
import torch

from octavo.errors import ConfigError, RequestError
from octavo.model_executor.input_batch import CachedRequestState, InputBatch
from octavo.model_executor.logits_processors import SamplingPenalties
from octavo.model_executor.model_config import ModelConfig
from octavo.model_executor.step_inputs import StepBuffer, StepInputs
from octavo.platform.facade import Platform
from octavo.platform.types import AttentionMetadata
from octavo.sched.output import NewRequestData, SchedulerOutput
from octavo.spec_decode.config import SpeculativeConfig
from octavo.spec_decode.verifier import positions_per_row
from octavo.structured_output.bitmask import GrammarBitmask

if TYPE_CHECKING:
    from octavo.lora.config import LoRAConfig
    from octavo.lora.slots import LoRASlots


class LogitsProcessor(Protocol):
    """``processor(logits [S, V] fp32, batch, rows [S], num_tokens [S]) -> logits``: adjusts
    logits row ``i``, the next token of batch row ``rows[i]`` after its first ``num_tokens[i]``
    tokens in ``batch.token_ids`` (penalties, logit bias, min_tokens, grammar bitmasks). Without
    drafts each row appears once with all its tokens; a row verifying drafts appears once per
    draft position, the drafts before it counted. A processor that cannot adjust some rows
    adjusts the others in place, then raises a RequestError naming those."""

    def applies_to(self, batch: InputBatch, rows: np.ndarray) -> bool:
        """Whether it may adjust any of ``rows``: their requests' settings decide, not their
        tokens, so the answer holds for every position of a step."""

    def __call__(
        self, logits: torch.Tensor, batch: InputBatch, rows: np.ndarray, num_tokens: np.ndarray
    ) -> torch.Tensor: ...


@dataclasses.dataclass(frozen=True)
class RunnerConfig:
    """Step limits the runner sizes its persistent buffers for."""

    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    quantization: Optional[str] = None  # "fp8" or "int8": linear weights quantised at load
    speculative_config: Optional[SpeculativeConfig] = None
    enforce_eager: bool = True  # False: the platform's graph_runner compiles the forward
    compile_cache_dir: Optional[str] = None
    lora_config: Optional[LoRAConfig] = None  # --enable-lora: adapters' slots in the batch


class BatchRunner:
    """Request states and the persistent batch of a model runner (see the module docstring).

    ``device`` is where the step's tensors go (``StepBuffer.to_device``); a runner that is not
    torch's keeps it ``cpu`` and reads the host arrays (``StepBuffer.np``) itself."""

    speculation = None  # a runner that speculates sets its Speculation
    lora: Optional[LoRASlots] = None  # a runner serving LoRA adapters sets its slots
    recompute_last_cached_block = False

    def __init__(
        self,
        model_config: ModelConfig,
        platform: Platform,
        runner_config: RunnerConfig,
        device: torch.device,
    ):
        if runner_config.block_size not in platform.capabilities.block_sizes:
            raise ConfigError(
                f"block size {runner_config.block_size} is not supported "
                f"by platform {platform.name!r} "
                f"(it offers {list(platform.capabilities.block_sizes)})"
            )
        self.model_config, self.config, self.platform = model_config, runner_config, platform
        self.block_size = runner_config.block_size
        self.device = device
        self.pin_host_memory = pin = platform.capabilities.pin_host_memory
        self.requests: dict[str, CachedRequestState] = {}
        self._kept_generators: dict[str, torch.Generator] = {}  # requests a failed step forgot
        penalties = SamplingPenalties(self.requests, model_config.eos_token_ids)
        self.logits_processors: list[LogitsProcessor] = [penalties]
        self.grammar: Optional[GrammarBitmask] = None
        max_blocks = -(-model_config.max_model_len // self.block_size)
        self.input_batch = InputBatch(
            runner_config.max_num_seqs,
            model_config.max_model_len,
            max_blocks,
            model_config.vocab_size,
            self.device,
            pin_memory=pin,
        )
        max_tokens, max_reqs = runner_config.max_num_batched_tokens, runner_config.max_num_seqs
        self.input_ids = StepBuffer(max_tokens, torch.int64, self.device, pin)
        self.positions = StepBuffer(max_tokens, torch.int64, self.device, pin)
        self.slot_mapping = StepBuffer(max_tokens, torch.int64, self.device, pin)
        self.query_start_loc = StepBuffer(max_reqs + 1, torch.int32, self.device, pin)
        self.seq_lens = StepBuffer(max_reqs, torch.int32, self.device, pin)
        self.logits_indices = StepBuffer(max(max_reqs, max_tokens), torch.int64, self.device, pin)
        self.block_table = StepBuffer(max_reqs * max_blocks, torch.int32, self.device, pin)
        self.arange = np.arange(max(max_tokens, max_reqs) + 1, dtype=np.int64)

    def enable_structured_output(self, backend: Callable[[], Any]) -> None:
        """Constrain requests with ``structured_outputs``: ``backend()`` gives the
        GrammarBackend; the platform's bitmask kernel applies the masks."""
        self.grammar = GrammarBitmask(backend, self.requests, self.platform.apply_token_bitmask())
        self.logits_processors.append(self.grammar)

    def check_alive(self) -> Optional[str]:
        return None  # the runner lives in the engine's process: it is alive while the engine is

    def shutdown(self) -> None:
        """Nothing to stop (a MultiprocExecutor stops its workers)."""

    def _forget_requests(self) -> None:
        """Drop every request's state and batch row; a seeded request's generator is kept for
        when it comes back, so its random stream goes on where it was."""
        for req_id, state in self.requests.items():
            if state.generator is not None:
                self._kept_generators[req_id] = state.generator
        self.requests.clear()
        for req_id in list(self.input_batch.req_id_to_index):
            self.input_batch.remove_request(req_id)
        self.input_batch.condense()

    def _update_states(self, so: SchedulerOutput) -> None:
        """Apply the scheduler's deltas to the request states and the persistent batch."""
        batch = self.input_batch
        if self.speculation is not None and so.finished_req_ids:  # while their rows are there:
            self.speculation.proposer.forget(so.finished_req_ids)  # a drafter may write KV
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
            self._kept_generators.pop(req_id, None)
            batch.remove_request(req_id)
        if self.grammar is not None and so.finished_req_ids:
            self.grammar.forget(so.finished_req_ids)
        new_states = self._new_request_states(so.scheduled_new_reqs)
        for req_id in [r for r in batch.req_id_to_index if r not in so.num_scheduled_tokens]:
            batch.remove_request(req_id)  # idle this step (e.g. preempted): keep its state only
        for state in new_states:
            self.requests[state.req_id] = state
            batch.add_request(state)
        rows, num_computed = [], []
        for cached in so.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            state.num_computed_tokens = cached.num_computed_tokens
            start = cached.block_table_start
            if start is None and cached.resumed_from_preemption:
                start = 0
            if start is not None:
                del state.block_ids[start:]
            if cached.new_block_ids:
                state.block_ids.extend(cached.new_block_ids)
            if cached.new_token_ids:
                state.output_token_ids.extend(cached.new_token_ids)
            row = batch.req_id_to_index.get(cached.req_id)
            if row is None:
                batch.add_request(state)
                continue
            rows.append(row)
            num_computed.append(cached.num_computed_tokens)
            if start is not None:
                batch.num_blocks[row] = start
            if cached.new_block_ids:
                batch.append_block_ids(row, cached.new_block_ids)
            if cached.new_token_ids:
                batch.append_token_ids(row, cached.new_token_ids)
        batch.num_computed_tokens[rows] = num_computed
        batch.condense()

    def _new_request_states(self, new_reqs: list[NewRequestData]) -> list[CachedRequestState]:
        """The runner's states for newly scheduled requests, built before anything changes so that
        a request whose state cannot be built fails alone (a RequestError naming it)."""
        states, failed = [], {}
        for new in new_reqs:
            try:
                state = CachedRequestState.from_new(new, self.device)
            except Exception as exc:  # noqa: BLE001 - whatever it is, it is this request's
                failed[new.req_id] = f"cannot set it up for sampling: {type(exc).__name__}: {exc}"
                continue
            states.append(state)
        if failed:
            raise RequestError(failed)  # nothing changed: kept generators stay kept
        for state in states:
            if self.lora is not None and state.lora_request is not None:
                self.lora.note(state.lora_request)
            if state.req_id in self._kept_generators:
                state.generator = self._kept_generators.pop(state.req_id)
        return states

    def _prepare_inputs(self, so: SchedulerOutput) -> StepInputs:
        """Gather the flat batch with array operations (no per-token Python loop)."""
        batch, bs = self.input_batch, self.block_size
        num_reqs = batch.num_reqs
        req_ids = batch.req_ids[:num_reqs]
        num_scheduled = np.fromiter(
            map(so.num_scheduled_tokens.__getitem__, req_ids), np.int64, num_reqs
        )
        num_drafts = (
            self.speculation.place_drafts(batch, so.scheduled_spec_token_ids)
            if so.scheduled_spec_token_ids
            else None
        )
        if self.lora is not None:  # the step's adapters in slots, its token -> slot mapping
            self.lora.prepare_step(batch.lora_ids[:num_reqs], num_scheduled, req_ids)
        cu_num_tokens = np.cumsum(num_scheduled)
        total = int(cu_num_tokens[-1])
        assert total == so.total_num_scheduled_tokens, (
            "num_scheduled_tokens does not add up to the total"
        )
        req_indices = np.repeat(self.arange[:num_reqs], num_scheduled)
        offsets = self.arange[:total] - np.repeat(cu_num_tokens - num_scheduled, num_scheduled)
        num_computed = batch.num_computed_tokens[:num_reqs].astype(np.int64)
        positions = self.positions.np[:total]
        np.add(num_computed[req_indices], offsets, out=positions)
        seq_lens = num_computed + num_scheduled
        num_known = batch.num_tokens[:num_reqs] + (0 if num_drafts is None else num_drafts)
        assert (seq_lens <= num_known).all(), "scheduled past the request's known tokens"

        max_len = batch.token_ids.shape[1]
        self.input_ids.np[:total] = batch.token_ids.ravel()[req_indices * max_len + positions]
        block_numbers = batch.block_table.ravel()[
            req_indices * batch.block_table.shape[1] + positions // bs
        ]
        np.add(block_numbers * bs, positions % bs, out=self.slot_mapping.np[:total])
        self.query_start_loc.np[0] = 0
        self.query_start_loc.np[1 : num_reqs + 1] = cu_num_tokens
        self.seq_lens.np[:num_reqs] = seq_lens

        sample_rows = np.flatnonzero(seq_lens == num_known)
        logits_indices = self._logits_indices(sample_rows, cu_num_tokens, num_drafts, total)
        batch.num_computed_tokens[:num_reqs] = seq_lens
        # a compact table, only as wide as this step's longest request needs
        num_cols = -(-int(seq_lens.max()) // bs)
        self.block_table.np[: num_reqs * num_cols].reshape(num_reqs, num_cols)[:] = (
            batch.block_table[:num_reqs, :num_cols]
        )
        metadata = AttentionMetadata(
            query_start_loc=self.query_start_loc.to_device(num_reqs + 1),
            seq_lens=self.seq_lens.to_device(num_reqs),
            block_table=self.block_table.to_device(num_reqs * num_cols).view(num_reqs, num_cols),
            slot_mapping=self.slot_mapping.to_device(total),
            max_query_len=int(num_scheduled.max()),
            max_seq_len=int(seq_lens.max()),
            num_actual_tokens=total,
            num_context_tokens=int(seq_lens.sum()),
        )
        return StepInputs(
            self.input_ids.to_device(total),
            self.positions.to_device(total),
            metadata,
            num_scheduled,
            sample_rows,
            logits_indices,
            num_drafts,
            None
            if num_drafts is None
            else self.speculation.draft_token_ids(batch, sample_rows, num_drafts, self.device),
            so.propose_drafts,
        )

    def _logits_indices(
        self,
        sample_rows: np.ndarray,
        cu_num_tokens: np.ndarray,
        num_drafts: Optional[np.ndarray],
        total: int,
    ) -> Optional[torch.Tensor]:
        """The tokens whose logits are taken: each sampling row's last, or its last ``1 + k``
        when it verifies ``k`` drafts; None when that is every token (all decodes, or every
        row verifying drafts)."""
        if num_drafts is not None:
            row, offset = positions_per_row(num_drafts[sample_rows])
            if len(row) == total:  # distinct tokens of the step, in order: all of them
                return None
            first = cu_num_tokens[sample_rows] - 1 - num_drafts[sample_rows]
            indices = first[row] + offset
        elif len(sample_rows) != total:
            indices = cu_num_tokens[sample_rows] - 1
        else:
            return None
        self.logits_indices.np[: len(indices)] = indices
        return self.logits_indices.to_device(len(indices))

    def processes_logits(self, rows: np.ndarray) -> bool:
        """Whether a logits processor may adjust any of the batch rows ``rows``."""
        return any(p.applies_to(self.input_batch, rows) for p in self.logits_processors)

    def process_logits(
        self,
        logits: torch.Tensor,
        rows: np.ndarray,
        num_tokens: np.ndarray,
        failed: dict[str, str],
    ) -> torch.Tensor:
        """Run the logits processors over the sampling rows. Rows a processor could not adjust
        (it processes the others, then raises a RequestError naming these) fail; their logits
        are made neutral so that sampling them cannot fail as well."""
        for process in self.logits_processors:
            try:
                logits = process(logits, self.input_batch, rows, num_tokens)
            except RequestError as exc:
                failed.update(exc.messages)
        if failed:
            req_ids = self.input_batch.req_ids
            logits[[i for i, row in enumerate(rows.tolist()) if req_ids[row] in failed]] = 0.0
        return logits

    def _keep_valid_samples(
        self, rows: np.ndarray, tokens: np.ndarray, vocab_size: int, failed: dict[str, str]
    ) -> np.ndarray:
        """Which sampling rows keep their tokens (``[S, W]``, -1 padded): not the failed ones,
        nor one whose token is no token (the sampler found no finite logit), which fails too."""
        req_ids = self.input_batch.req_ids
        kept = (tokens[:, 0] >= 0) & (tokens < vocab_size).all(axis=1)
        for i in np.flatnonzero(~kept).tolist():
            failed.setdefault(
                req_ids[rows[i]], "the sampler found no token to sample (no finite logit)"
            )
        if failed:
            kept &= np.array([req_ids[row] not in failed for row in rows.tolist()])
        return kept

    def _emit_samples(
        self,
        rows: np.ndarray,
        tokens: np.ndarray,
        row_logprobs: list,
        failed: dict[str, str],
        sampled_token_ids: list[list[int]],
        logprobs: list,
    ) -> np.ndarray:
        """Keep the valid samples of ``rows`` (``tokens [S, W]``, -1 padded), append them to
        their requests and the grammars, and fill the step's ``sampled_token_ids`` and
        ``logprobs`` (per batch row) with them. Returns which sampling rows kept theirs."""
        kept = self._keep_valid_samples(rows, tokens, self.model_config.vocab_size, failed)
        emitted = self._record_sampled(rows[kept], tokens[kept])
        if self.grammar is not None:
            self.grammar.accept_emitted(self.input_batch, rows[kept], emitted)
        for i, row_tokens in zip(np.flatnonzero(kept).tolist(), emitted):
            sampled_token_ids[rows[i]] = row_tokens
            logprobs[rows[i]] = row_logprobs[i]
        return kept

    def _record_sampled(self, rows: np.ndarray, tokens: np.ndarray) -> list[list[int]]:
        """Append each row's sampled tokens (``[S, W]``, -1 padded) to its request (batch row
        and state); returns them, a list per row."""
        requests, req_ids = self.requests, self.input_batch.req_ids
        emitted = self.input_batch.append_sampled(rows, tokens)
        for row, row_tokens in zip(rows.tolist(), emitted):
            requests[req_ids[row]].output_token_ids.extend(row_tokens)
        return emitted

    # --- start-up profiling --------------------------------------------------------------------
