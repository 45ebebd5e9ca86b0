"""The model runner: a SchedulerOutput in, sampled tokens out, over the paged KV cache.

Each step it applies the scheduler's deltas to the persistent :class:`InputBatch`, runs the
cache operations (swap, copy-on-write), gathers one flat batch (``input_ids``, ``positions``,
``query_start_loc``, ``seq_lens``, ``block_table``, ``slot_mapping``) with array operations into
persistent buffers, runs the model, computes logits only where a token is sampled, and samples
with the platform's sampler.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Union

import numpy as np
import torch

from octavo.errors import ConfigError, RequestError
from octavo.kv_cache.transfers import TransferKind, apply_block_transfers
from octavo.model_executor.input_batch import CachedRequestState, InputBatch
from octavo.model_executor.loader import load_model
from octavo.model_executor.logits_processors import SamplingPenalties
from octavo.model_executor.logprobs import compute_logprobs
from octavo.model_executor.memory import PeakMemory, zeros_on_touch
from octavo.model_executor.model_config import ModelConfig
from octavo.model_executor.runner_output import ModelRunnerOutput
from octavo.models.layers.attention import Attention
from octavo.models.layers.linear import TPGroup
from octavo.models.layers.packed import pack_linears
from octavo.models.layers.widen import widen_matmuls
from octavo.platform.facade import Platform
from octavo.platform.types import AttentionMetadata
from octavo.sampling_params import SamplingParams
from octavo.sched.output import NewRequestData, SchedulerOutput

LogitsProcessor = Callable[[torch.Tensor, InputBatch, np.ndarray], torch.Tensor]
"""``fn(logits [S, V] fp32, batch, rows [S]) -> logits``: adjusts the logits of batch rows
``rows`` before sampling (penalties, logit bias, min_tokens, grammar bitmasks). A processor that
cannot adjust some rows adjusts the others in place, then raises a RequestError naming those."""


@dataclasses.dataclass(frozen=True)
class RunnerConfig:
    """Step limits the runner sizes its persistent buffers for."""

    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    quantization: Optional[str] = (
        None  # "fp8": linear weights quantised at load (EngineArgs.quantization)
    )


@dataclasses.dataclass(frozen=True)
class ProfileResult:
    """What the start-up profile run measured: the activation peak of a max-size step."""

    peak_activation_bytes: int
    num_tokens: int
    num_reqs: int


@dataclasses.dataclass(slots=True)
class StepInputs:
    """One step's flat batch, ready for the model."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    num_scheduled: np.ndarray  # [R]
    sample_rows: np.ndarray  # [S] batch rows that sample this step
    logits_indices: Optional[
        torch.Tensor
    ]  # [S] token of each sampling row; None: every token samples


class _StepBuffer:
    """A persistent host tensor with a numpy view, mirrored on the device when it is not the host;
    ``pin`` (the platform's ``Capabilities.pin_host_memory``) page-locks the host tensor."""

    def __init__(self, size: int, dtype: torch.dtype, device: torch.device, pin: bool = False):
        on_host = device.type == "cpu"
        self.cpu = torch.zeros(size, dtype=dtype, pin_memory=pin)
        self.np = self.cpu.numpy()
        self.dev = self.cpu if on_host else torch.zeros(size, dtype=dtype, device=device)

    def to_device(self, n: int) -> torch.Tensor:
        if self.dev is not self.cpu:
            self.dev[:n].copy_(self.cpu[:n], non_blocking=True)
        return self.dev[:n]


class ModelRunner:
    """Loads the model and executes scheduled steps on it (see the module docstring)."""

    def __init__(
        self,
        model_config: ModelConfig,
        platform: Platform,
        runner_config: RunnerConfig = RunnerConfig(),
        *,
        device: Optional[Union[str, torch.device]] = None,
        tp: TPGroup = TPGroup(),
    ):
        if runner_config.block_size not in platform.capabilities.block_sizes:
            raise ConfigError(
                f"block size {runner_config.block_size} is not supported "
                f"by platform {platform.name!r} "
                f"(it offers {list(platform.capabilities.block_sizes)})"
            )
        self.model_config, self.config = model_config, runner_config
        self.block_size = runner_config.block_size
        self.device = torch.device(device) if device is not None else platform.device_init()
        self.pin_host_memory = platform.capabilities.pin_host_memory
        self.model = load_model(
            model_config,
            platform,
            block_size=self.block_size,
            device=self.device,
            tp=tp,
            quantization=runner_config.quantization,
        )
        widen_matmuls(self.model, platform.capabilities.widened_matmul_dtypes)
        pack_linears(self.model, platform.linear_packer(model_config.dtype))
        self.forward = platform.graph_runner(self.model, runner_config)
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.sampler = platform.sampler(model_config.vocab_size)
        self.requests: dict[str, CachedRequestState] = {}
        self._kept_generators: dict[
            str, torch.Generator
        ] = {}  # of requests forgotten by a failed step
        self.logits_processors: list[LogitsProcessor] = [
            SamplingPenalties(self.requests, model_config.eos_token_ids)
        ]
        max_blocks = -(-model_config.max_model_len // self.block_size)
        self.input_batch = InputBatch(
            runner_config.max_num_seqs,
            model_config.max_model_len,
            max_blocks,
            model_config.vocab_size,
            self.device,
            pin_memory=self.pin_host_memory,
        )
        max_tokens, max_reqs = runner_config.max_num_batched_tokens, runner_config.max_num_seqs
        pin = self.pin_host_memory
        self.input_ids = _StepBuffer(max_tokens, torch.int64, self.device, pin)
        self.positions = _StepBuffer(max_tokens, torch.int64, self.device, pin)
        self.slot_mapping = _StepBuffer(max_tokens, torch.int64, self.device, pin)
        self.query_start_loc = _StepBuffer(max_reqs + 1, torch.int32, self.device, pin)
        self.seq_lens = _StepBuffer(max_reqs, torch.int32, self.device, pin)
        self.logits_indices = _StepBuffer(max_reqs, torch.int64, self.device, pin)
        self.block_table = _StepBuffer(max_reqs * max_blocks, torch.int32, self.device, pin)
        self.arange = np.arange(max(max_tokens, max_reqs) + 1, dtype=np.int64)
        self.kv_caches: list[torch.Tensor] = []
        self.host_kv_caches: list[torch.Tensor] = []

    # --- KV cache ----------------------------------------------------------------------------

    def kv_cache_bytes_per_block(self) -> int:
        """Bytes one block takes across all layers, in the backends' layouts (for KV sizing)."""
        size = self.model_config.dtype.itemsize
        return sum(
            int(np.prod(layer.backend.kv_cache_shape(1))) * size for layer in self.attention_layers
        )

    def initialize_kv_cache(self, num_blocks: int, num_host_blocks: int = 0) -> None:
        """Allocate each layer's paged cache (``num_blocks`` blocks) and bind it to the layer;
        ``num_host_blocks`` > 0 also allocates host caches that swapped-out blocks go to."""
        dtype = self.model_config.dtype
        self.kv_caches = [
            zeros_on_touch(layer.backend.kv_cache_shape(num_blocks), dtype, self.device)
            for layer in self.attention_layers
        ]
        self.host_kv_caches = (
            [
                torch.zeros(
                    layer.backend.kv_cache_shape(num_host_blocks), dtype=dtype, pin_memory=True
                )
                if self.pin_host_memory
                else zeros_on_touch(layer.backend.kv_cache_shape(num_host_blocks), dtype, "cpu")
                for layer in self.attention_layers
            ]
            if num_host_blocks
            else []
        )
        self._bind(self.kv_caches)

    def _bind(self, caches: list[torch.Tensor]) -> None:
        for i, layer in enumerate(self.attention_layers):
            layer.kv_cache = caches[i] if caches else None

    def _run_cache_ops(self, so: SchedulerOutput) -> None:
        """Apply the step's KV block transfers (copy-on-write, swap out/in), in planned order."""
        if not so.kv_transfers:
            return
        if (
            any(t.kind is not TransferKind.COPY for t in so.kv_transfers)
            and not self.host_kv_caches
        ):
            raise RuntimeError(
                "swap requested but no host KV cache was allocated (num_host_blocks=0)"
            )
        for i, layer in enumerate(self.attention_layers):
            host = [self.host_kv_caches[i]] if self.host_kv_caches else []
            apply_block_transfers(layer.backend, [self.kv_caches[i]], host, so.kv_transfers)

    # --- the step ----------------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one scheduled step and return the tokens sampled for each scheduled request.

        A RequestError (a failure that belongs to some requests) leaves the runner holding no
        request: the scheduler restarts the others and sends each again in full."""
        try:
            self._update_states(scheduler_output)
            self._run_cache_ops(scheduler_output)
            if scheduler_output.total_num_scheduled_tokens == 0:
                return ModelRunnerOutput.empty()
            step = self._prepare_inputs(scheduler_output)
            hidden_states = self.forward(step.input_ids, step.positions, step.attn_metadata)
            return self._sample(hidden_states, step)
        except RequestError:
            self._forget_requests()
            raise

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
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
            self._kept_generators.pop(req_id, None)
            batch.remove_request(req_id)
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
        assert (seq_lens <= batch.num_tokens[:num_reqs]).all(), (
            "scheduled past the request's known tokens"
        )

        max_len = batch.token_ids.shape[1]
        self.input_ids.np[:total] = batch.token_ids.ravel()[req_indices * max_len + positions]
        block_numbers = batch.block_table.ravel()[
            req_indices * batch.block_table.shape[1] + positions // bs
        ]
        np.add(block_numbers * bs, positions % bs, out=self.slot_mapping.np[:total])
        self.query_start_loc.np[0] = 0
        self.query_start_loc.np[1 : num_reqs + 1] = cu_num_tokens
        self.seq_lens.np[:num_reqs] = seq_lens

        sample_rows = np.flatnonzero(seq_lens == batch.num_tokens[:num_reqs])
        num_samples = len(sample_rows)
        logits_indices = None  # all decodes: every token is a sampling row's last one
        if num_samples != total:
            self.logits_indices.np[:num_samples] = cu_num_tokens[sample_rows] - 1
            logits_indices = self.logits_indices.to_device(num_samples)
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
        )
        return StepInputs(
            self.input_ids.to_device(total),
            self.positions.to_device(total),
            metadata,
            num_scheduled,
            sample_rows,
            logits_indices,
        )

    def _sample(self, hidden_states: torch.Tensor, step: StepInputs) -> ModelRunnerOutput:
        batch, rows = self.input_batch, step.sample_rows
        num_reqs = len(step.num_scheduled)
        req_ids = list(batch.req_ids[:num_reqs])
        sampled_token_ids: list[list[int]] = [[] for _ in range(num_reqs)]
        logprobs = [None] * num_reqs
        failed: dict[str, str] = {}
        if len(rows):
            if step.logits_indices is not None:
                hidden_states = hidden_states.index_select(0, step.logits_indices)
            logits = self.model.compute_logits(hidden_states).float()
            num_logprobs = batch.num_logprobs[rows]
            raw_logits = (
                logits.clone() if self.logits_processors and (num_logprobs >= 0).any() else logits
            )
            logits = self._process_logits(logits, rows, failed)
            sampled = self.sampler(logits, batch.sampling_metadata(rows))
            row_logprobs = compute_logprobs(raw_logits, sampled, num_logprobs)
            tokens = sampled.cpu().numpy()  # the step's one device sync
            kept = self._keep_valid_samples(rows, tokens, logits.shape[-1], failed)
            self._record_sampled(rows[kept], tokens[kept])
            for i in np.flatnonzero(kept).tolist():
                sampled_token_ids[rows[i]] = [int(tokens[i])]
                logprobs[rows[i]] = row_logprobs[i]
        return ModelRunnerOutput(req_ids, sampled_token_ids, logprobs, failed)

    def _process_logits(
        self, logits: torch.Tensor, rows: np.ndarray, failed: dict[str, str]
    ) -> torch.Tensor:
        """Run the logits processors over the sampling rows. Rows a processor could not adjust
        (it processes the others, then raises a RequestError naming these) fail; their logits
        are made neutral so that sampling them cannot fail as well."""
        for process in self.logits_processors:
            try:
                logits = process(logits, self.input_batch, rows)
            except RequestError as exc:
                failed.update(exc.messages)
        if failed:
            req_ids = self.input_batch.req_ids
            logits[[i for i, row in enumerate(rows.tolist()) if req_ids[row] in failed]] = 0.0
        return logits

    def _keep_valid_samples(
        self, rows: np.ndarray, tokens: np.ndarray, vocab_size: int, failed: dict[str, str]
    ) -> np.ndarray:
        """Which sampling rows keep their token: not the failed ones, nor one whose token is no
        token (the sampler found no finite logit), which fails too."""
        req_ids = self.input_batch.req_ids
        kept = (tokens >= 0) & (tokens < vocab_size)
        for i in np.flatnonzero(~kept).tolist():
            failed.setdefault(
                req_ids[rows[i]], "the sampler found no token to sample (no finite logit)"
            )
        if failed:
            kept &= np.array([req_ids[row] not in failed for row in rows.tolist()])
        return kept

    def _record_sampled(self, rows: np.ndarray, tokens: np.ndarray) -> None:
        """Append each sampled token to its request (batch row and state)."""
        batch = self.input_batch
        fits = batch.num_tokens[rows] < batch.max_model_len
        batch.token_ids[rows[fits], batch.num_tokens[rows[fits]]] = tokens[fits]
        batch.num_tokens[rows[fits]] += 1
        for row, token in zip(rows.tolist(), tokens.tolist()):
            self.requests[batch.req_ids[row]].output_token_ids.append(token)

    # --- start-up profiling --------------------------------------------------------------------

    def profile_run(self) -> ProfileResult:
        """Run one max-size step (``max_num_batched_tokens`` prompt tokens over up to
        ``max_num_seqs`` requests, all sampling) on a scratch KV cache and report its peak
        activation memory, for sizing the real KV cache. Leaves no request behind."""
        cfg, bs = self.config, self.block_size
        num_reqs = min(cfg.max_num_seqs, cfg.max_num_batched_tokens)
        base, extra = divmod(cfg.max_num_batched_tokens, num_reqs)
        lengths = [
            min(base + (i < extra), self.model_config.max_model_len) for i in range(num_reqs)
        ]
        num_blocks = [-(-n // bs) for n in lengths]
        starts = np.concatenate([[0], np.cumsum(num_blocks)]).tolist()
        params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, min_p=0.01, seed=0)
        new_reqs = [
            NewRequestData(
                f"__profile_{i}", [0] * n, params, list(range(starts[i], starts[i + 1])), 0
            )
            for i, n in enumerate(lengths)
        ]
        saved = self.kv_caches
        dtype = self.model_config.dtype
        scratch = [
            torch.zeros(layer.backend.kv_cache_shape(starts[-1]), dtype=dtype, device=self.device)
            for layer in self.attention_layers
        ]
        self._bind(scratch)
        step = SchedulerOutput(
            new_reqs, [], {r.req_id: len(r.prompt_token_ids) for r in new_reqs}, sum(lengths)
        )
        try:
            with PeakMemory(self.device) as peak:
                self.execute_model(step)
        finally:
            self.execute_model(
                SchedulerOutput([], [], {}, 0, finished_req_ids={r.req_id for r in new_reqs})
            )
            self.kv_caches = saved
            self._bind(saved)
        return ProfileResult(peak.bytes, sum(lengths), num_reqs)
