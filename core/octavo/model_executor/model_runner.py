"""The torch model runner: a SchedulerOutput in, sampled tokens out, over the paged KV cache.

Each step it applies the scheduler's deltas and gathers the flat batch (:mod:`.batch_runner`),
runs the cache operations (swap, copy-on-write), runs the model, computes logits only where a
token is sampled, and samples with the platform's sampler. A platform may bring a runner of its
own instead (the ``octavo_model_runner`` hook).
"""

from __future__ import annotations

import logging
from typing import Optional, Union

import numpy as np
import torch

from octavo.errors import RequestError
from octavo.kv_cache.sizing import KVCacheSizing
from octavo.kv_cache.transfers import TransferKind, apply_block_transfers
from octavo.lora.slots import lora_slots_for
from octavo.model_executor.batch_runner import BatchRunner, RunnerConfig
from octavo.model_executor.kv_plan import plan_runner_kv_cache
from octavo.model_executor.loader import load_model
from octavo.model_executor.logprobs import compute_logprobs
from octavo.model_executor.memory import zeros_on_touch
from octavo.model_executor.model_config import ModelConfig
from octavo.model_executor.profile import ProfileResult, profile_run, warm_up
from octavo.model_executor.runner_output import ModelRunnerOutput
from octavo.model_executor.step_inputs import StepInputs
from octavo.models.layers.attention import Attention
from octavo.models.layers.decoder_stack import attach_decoder_stacks
from octavo.models.layers.linear import TPGroup
from octavo.models.layers.packed import pack_linears
from octavo.models.layers.widen import widen_matmuls
from octavo.platform.facade import Platform
from octavo.sched.output import SchedulerOutput
from octavo.spec_decode.proposer import ProposeContext
from octavo.spec_decode.speculation import Speculation

logger = logging.getLogger(__name__)


class ModelRunner(BatchRunner):
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
        device = torch.device(device) if device is not None else platform.device_init()
        super().__init__(model_config, platform, runner_config, device)
        self.tp = tp
        self.model, self.forward = self.build_model(model_config)
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.sampler = platform.sampler(model_config.vocab_size)
        spec = runner_config.speculative_config
        self.speculation: Optional[Speculation] = (
            None if spec is None else Speculation(spec, self, platform.rejection_sampler())
        )
        if self.speculation is not None:  # a draft model's KV caches sit beside the target's
            self.attention_layers += self.speculation.proposer.attention_layers
        self.recompute_last_cached_block = (
            self.speculation is not None and self.speculation.proposer.recompute_last_cached_block
        )
        self.kv_caches: list[torch.Tensor] = []
        self.host_kv_caches: list[torch.Tensor] = []

    def build_model(self, model_config: ModelConfig):
        """``(model, forward)``: :meth:`load_model` with the platform's forward for it, compiled
        when ``--no-enforce-eager`` asks and the platform can (else it says so)."""
        # A compiled forward traces the modules; the platform's decoder stack is opaque to it,
        # and it runs none of the LoRA layers' deltas.
        lora = self.config.lora_config is not None
        model = self.load_model(model_config, stack_layers=self.config.enforce_eager and not lora)
        if lora:
            self.lora = lora_slots_for(self, model)
        forward = self.platform.graph_runner(model, self.config)
        if not self.config.enforce_eager and not getattr(forward, "compiled", False):
            logger.warning(
                "--no-enforce-eager: platform %r builds no compiled graph for this model here; "
                "the model runs eagerly",
                self.platform.name,
            )
        return model, forward

    def load_model(
        self,
        model_config: ModelConfig,
        model_cls: Optional[type] = None,
        stack_layers: bool = True,
    ):
        """A model (of ``model_cls``, else its config's architecture) of this runner's
        platform, block size, device and quantisation, its linears packed, and its decoder
        layers run by the platform's stack where it has one (``stack_layers``)."""
        platform = self.platform
        model = load_model(
            model_config,
            platform,
            block_size=self.block_size,
            device=self.device,
            tp=self.tp,
            quantization=self.config.quantization,
            model_cls=model_cls,
        )
        widen_matmuls(model, platform.capabilities.widened_matmul_dtypes)
        pack_linears(model, platform.linear_packer(model_config.dtype))
        return attach_decoder_stacks(model, platform) if stack_layers else model

    # --- KV cache and lifecycle (what the engine core calls, as on a MultiprocExecutor) ------

    def plan_kv_cache(self, cache_config) -> KVCacheSizing:
        """This runner's KV cache size, from its own memory (:mod:`.kv_plan`)."""
        return plan_runner_kv_cache(self, cache_config)

    def kv_cache_bytes_per_block(self, layers: Optional[list[Attention]] = None) -> int:
        """Bytes one block takes across ``layers`` (default: all, a draft model's included), in
        the backends' layouts (for KV sizing)."""
        size = self.model_config.dtype.itemsize
        return sum(
            int(np.prod(layer.backend.kv_cache_shape(1))) * size
            for layer in (self.attention_layers if layers is None else layers)
        )

    def parameter_bytes(self) -> int:
        """Bytes of the weights, a draft model's and the LoRA slots' included."""
        models = [self.model]
        if self.speculation is not None and hasattr(self.speculation.proposer, "model"):
            models.append(self.speculation.proposer.model)
        lora = 0 if self.lora is None else self.lora.num_bytes()  # the adapters' slots
        return lora + sum(p.numel() * p.element_size() for m in models for p in m.parameters())

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
        if getattr(self.forward, "compiled", False):
            warm_up(self)  # compile the graphs now, not at the first requests

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
            if self.speculation is not None:
                self.speculation.proposer.forward_step(step, hidden_states)
            return self._sample(hidden_states, step)
        except RequestError:
            self._forget_requests()
            raise

    def _sample(self, hidden_states: torch.Tensor, step: StepInputs) -> ModelRunnerOutput:
        batch, rows = self.input_batch, step.sample_rows
        num_reqs = len(step.num_scheduled)
        req_ids = list(batch.req_ids[:num_reqs])
        sampled_token_ids: list[list[int]] = [[] for _ in range(num_reqs)]
        logprobs = [None] * num_reqs
        failed: dict[str, str] = {}
        spec_token_ids: dict[str, list[int]] = {}
        if len(rows):
            step_hidden_states = hidden_states
            if step.logits_indices is not None:
                hidden_states = hidden_states.index_select(0, step.logits_indices)
            logits = self.model.compute_logits(hidden_states).float()
            if step.num_drafts is None:
                tokens, row_logprobs = self.sample_tokens(logits, rows, failed)
            else:
                tokens, row_logprobs = self.speculation.sample(logits, rows, step, failed)
            kept = self._emit_samples(
                rows, tokens, row_logprobs, failed, sampled_token_ids, logprobs
            )
            if self.speculation is not None:
                proposing = rows[kept]
                process = self.process_logits if self.processes_logits(proposing) else None
                context = ProposeContext(batch, proposing, step, step_hidden_states, process)
                spec_token_ids = self.speculation.propose(context, step.propose_all)
        return ModelRunnerOutput(req_ids, sampled_token_ids, logprobs, failed, spec_token_ids)

    def sample_tokens(self, logits: torch.Tensor, rows: np.ndarray, failed: dict[str, str]):
        """One token per sampling row with the platform's sampler, after the logits processors:
        ``(tokens [S, 1], logprobs per row)``."""
        batch = self.input_batch
        num_logprobs = batch.num_logprobs[rows]
        raw_logits = (
            logits.clone() if self.logits_processors and (num_logprobs >= 0).any() else logits
        )
        logits = self.process_logits(logits, rows, batch.num_tokens[rows], failed)
        sampled = self.sampler(logits, batch.sampling_metadata(rows))
        row_logprobs = compute_logprobs(raw_logits, sampled, num_logprobs)
        return sampled.cpu().numpy()[:, None], row_logprobs  # the step's one device sync

    def profile_run(self) -> ProfileResult:
        """Run one max-size step on a scratch KV cache and report its peak activation memory
        (``octavo.model_executor.profile``); leaves no request behind."""
        return profile_run(self)
