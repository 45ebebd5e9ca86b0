"""The tpu platform's model runner: the core's batch bookkeeping, the model and sampling in JAX.

It takes the same ``SchedulerOutput`` as the core's torch runner and returns the same
``ModelRunnerOutput``; request states, the persistent batch and each step's flat inputs come
from :class:`~octavo.model_executor.batch_runner.BatchRunner` (host arrays). XLA compiles per
shape, so each step is padded: tokens to a power-of-two bucket (16 up to
``max_num_batched_tokens``), the block table to a power-of-two width (16 blocks up to a
request's maximum), sampling rows to a power-of-two bucket (8 up to ``max_num_seqs``). Each
shape compiles once, on first use; start-up says how many there can be.

Sampling stays on the device unless a sampling row needs the host: penalties, logit bias,
``min_tokens``, grammars and logprobs run the core's logits processors on the logits in torch,
then the same JAX sampler draws from the result.
"""

from __future__ import annotations

import logging

import jax
import numpy as np
import torch

from octavo.errors import ConfigError, RequestError
from octavo.kv_cache.sizing import KVCacheSizing, plan_kv_cache
from octavo.model_executor.batch_runner import BatchRunner, RunnerConfig
from octavo.model_executor.loader import load_model
from octavo.model_executor.logprobs import compute_logprobs
from octavo.model_executor.model_config import ModelConfig
from octavo.model_executor.runner_output import ModelRunnerOutput
from octavo.model_executor.step_inputs import StepInputs
from octavo.platform.facade import Platform
from octavo.sched.output import SchedulerOutput
from octavo_tpu import runtime
from octavo_tpu.bridge import row_keys, to_torch
from octavo_tpu.kernels import sampler
from octavo_tpu.kv_cache import JaxKVCache
from octavo_tpu.model import StepArrays, compute_logits, forward, params_from_torch

logger = logging.getLogger(__name__)


def buckets(smallest: int, largest: int) -> tuple[int, ...]:
    """Powers of two from ``smallest`` while below ``largest``, then ``largest``."""
    sizes, size = [], max(1, smallest)
    while size < largest:
        sizes.append(size)
        size *= 2
    return (*sizes, largest)


def bucket(sizes: tuple[int, ...], n: int) -> int:
    return next(size for size in sizes if size >= n)


def _sample_from_hidden(
    shape, lm_head, hidden, indices, temperature, top_k, top_p, min_p, keys, *, all_greedy
):
    logits = compute_logits(shape, lm_head, hidden, indices)
    return sampler.sample(
        logits,
        temperature,
        top_k,
        top_p,
        min_p,
        keys,
        all_greedy=all_greedy,
        interpret=shape.interpret,
    )


# Jitted once per process with the model's shape static: engines of one model (and tests
# building many) share each compiled step. The forward donates the KV caches (updated in
# place).
_forward = jax.jit(forward, static_argnums=0, donate_argnums=2)
_logits = jax.jit(compute_logits, static_argnums=0)
_sample_hidden = jax.jit(_sample_from_hidden, static_argnums=0, static_argnames=("all_greedy",))


class JaxModelRunner(BatchRunner):
    """Runs the Llama family in JAX on a TPU (or interpreted on the CPU); see the module
    docstring."""

    def __init__(
        self,
        model_config: ModelConfig,
        platform: Platform,
        runner_config: RunnerConfig,
        *,
        interpret: bool,
    ):
        if runner_config.speculative_config is not None:
            raise ConfigError(
                "the tpu platform's JAX runner does not run speculative decoding yet: drop "
                "--speculative-config, or use --device cpu"
            )
        if runner_config.quantization is not None:
            raise ConfigError(
                f"the tpu platform does not run --quantization {runner_config.quantization}: "
                "it runs float32 and bfloat16 weights"
            )
        super().__init__(model_config, platform, runner_config, torch.device("cpu"))
        self.interpret = interpret
        self.jax_device = runtime.jax_device(interpret)
        torch_model = load_model(model_config, platform, block_size=self.block_size, device="cpu")
        self.shape, params = params_from_torch(torch_model, interpret)
        del torch_model
        self.params = jax.device_put(params, self.jax_device)
        self.kv = JaxKVCache(
            self.shape.num_layers,
            self.block_size,
            self.shape.num_kv_heads,
            self.shape.head_dim,
            self.params["embed"].dtype,
        )
        cfg = runner_config
        self.token_buckets = buckets(16, cfg.max_num_batched_tokens)
        max_blocks = self.input_batch.block_table.shape[1]
        self.block_buckets = buckets(min(16, max_blocks), max_blocks)
        self.sample_buckets = buckets(8, cfg.max_num_seqs)
        self._compiled: set[tuple] = set()
        num_forward = len(self.token_buckets) * len(self.block_buckets)
        logger.info(
            "tpu runner on %s%s: XLA compiles each shape on first use, up to %d forward shapes "
            "(tokens %s x block-table widths %s) and %d sampling shapes (rows %s)",
            self.jax_device,
            " (Pallas interpreted)" if interpret else "",
            num_forward,
            list(self.token_buckets),
            list(self.block_buckets),
            len(self.sample_buckets),
            list(self.sample_buckets),
        )

    # --- KV cache and lifecycle -------------------------------------------------------------

    def parameter_bytes(self) -> int:
        return sum(x.nbytes for x in jax.tree_util.tree_leaves(self.params))

    def plan_kv_cache(self, cache_config) -> KVCacheSizing:
        """The cache size from the JAX device's memory, less the weights (no profile run:
        ``kv_cache_memory`` or ``gpu_memory_utilization`` leave the activations' room)."""
        mc = self.model_config
        return plan_kv_cache(
            cache_config,
            self.platform.capabilities,
            self.platform.memory_info(self.device),
            model_memory=self.parameter_bytes(),
            num_layers=mc.num_hidden_layers,
            num_kv_heads=self.shape.num_kv_heads,
            head_dim=self.shape.head_dim,
            dtype=mc.dtype,
            max_model_len=mc.max_model_len,
        )

    def initialize_kv_cache(self, num_blocks: int, num_host_blocks: int = 0) -> None:
        self.kv.allocate(num_blocks, num_host_blocks, self.jax_device)

    # --- the step ---------------------------------------------------------------------------

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one scheduled step; a RequestError leaves the runner holding no request, as on
        the torch runner."""
        try:
            self._update_states(scheduler_output)
            self.kv.apply(scheduler_output.kv_transfers)
            if scheduler_output.total_num_scheduled_tokens == 0:
                return ModelRunnerOutput.empty()
            step = self._prepare_inputs(scheduler_output)
            arrays = self._step_arrays(step)
            hidden, self.kv.caches = _forward(self.shape, self.params, self.kv.caches, arrays)
            return self._sample(hidden, step)
        except RequestError:
            self._forget_requests()
            raise

    def _note_shape(self, *key) -> None:
        if key not in self._compiled:
            self._compiled.add(key)
            logger.info(
                "tpu runner: first step of shape %s (%d so far; XLA compiles each once a process)",
                key,
                len(self._compiled),
            )

    def _step_arrays(self, step: StepInputs) -> StepArrays:
        """The step's flat inputs padded to its token bucket and block-table width."""
        metadata = step.attn_metadata
        total = metadata.num_actual_tokens
        num_tokens = bucket(self.token_buckets, total)
        width = bucket(self.block_buckets, -(-metadata.max_seq_len // self.block_size))
        self._note_shape("forward", num_tokens, width)
        positions = np.zeros(num_tokens, np.int32)
        positions[:total] = self.positions.np[:total]
        input_ids = np.zeros(num_tokens, np.int32)
        input_ids[:total] = self.input_ids.np[:total]
        slots = np.full(num_tokens, self.kv.num_blocks * self.block_size, np.int32)
        slots[:total] = self.slot_mapping.np[:total]
        token_rows = np.zeros(num_tokens, np.int32)
        token_rows[:total] = np.repeat(np.arange(len(step.num_scheduled)), step.num_scheduled)
        context_lens = np.zeros(num_tokens, np.int32)
        context_lens[:total] = positions[:total] + 1
        block_table = self.input_batch.block_table[:, :width]
        arrays = (input_ids, positions, slots, token_rows, context_lens, block_table)
        return StepArrays(*jax.device_put(arrays, self.jax_device))

    def _sample(self, hidden: jax.Array, step: StepInputs) -> ModelRunnerOutput:
        batch, rows = self.input_batch, step.sample_rows
        num_reqs = len(step.num_scheduled)
        sampled_token_ids: list[list[int]] = [[] for _ in range(num_reqs)]
        logprobs: list = [None] * num_reqs
        failed: dict[str, str] = {}
        if len(rows):
            tokens, row_logprobs = self._sample_rows(hidden, step, failed)
            self._emit_samples(
                rows, tokens[:, None], row_logprobs, failed, sampled_token_ids, logprobs
            )
        req_ids = list(batch.req_ids[:num_reqs])
        return ModelRunnerOutput(req_ids, sampled_token_ids, logprobs, failed)

    def _sample_rows(self, hidden, step: StepInputs, failed: dict[str, str]):
        """``(tokens [S] int64, logprobs per row)`` for the step's sampling rows."""
        batch, rows = self.input_batch, step.sample_rows
        count = len(rows)
        padded = bucket(self.sample_buckets, count)
        self._note_shape("sample", padded)
        indices = np.zeros(padded, np.int32)
        indices[:count] = (
            np.arange(count) if step.logits_indices is None else step.logits_indices.numpy()
        )
        metadata = batch.sampling_metadata(rows)
        params = [
            _padded(getattr(metadata, name).numpy(), padded)
            for name in ("temperature", "top_k", "top_p", "min_p")
        ]
        params[2][count:] = 1.0  # top_p of padding rows: off
        keys = _padded(row_keys(metadata, count), padded)
        args = jax.device_put((indices, *params, keys), self.jax_device)
        on_host = (
            batch.adjusts_logits[rows].any()
            or batch.constrained[rows].any()
            or (batch.num_logprobs[rows] >= 0).any()
        )
        if not on_host:
            tokens = _sample_hidden(
                self.shape, self.params["lm_head"], hidden, *args, all_greedy=metadata.all_greedy
            )
            return np.asarray(tokens)[:count].astype(np.int64), [None] * count
        logits = to_torch(_logits(self.shape, self.params["lm_head"], hidden, args[0]))[:count]
        raw_logits = logits.clone()
        logits = self.process_logits(logits, rows, batch.num_tokens[rows], failed)
        processed = jax.device_put(_padded(logits.numpy(), padded), self.jax_device)
        tokens = sampler.sample(
            processed, *args[1:], all_greedy=metadata.all_greedy, interpret=self.interpret
        )
        tokens = np.asarray(tokens)[:count].astype(np.int64)
        row_logprobs = compute_logprobs(
            raw_logits, torch.from_numpy(tokens), batch.num_logprobs[rows]
        )
        return tokens, row_logprobs


def _padded(array: np.ndarray, rows: int) -> np.ndarray:
    """``array`` with zero rows appended up to ``rows``."""
    out = np.zeros((rows, *array.shape[1:]), array.dtype)
    out[: len(array)] = array
    return out


def make_runner(interpret: bool):
    """The factory the ``octavo_model_runner`` hook returns."""

    def factory(model_config: ModelConfig, platform: Platform, runner_config: RunnerConfig):
        return JaxModelRunner(model_config, platform, runner_config, interpret=interpret)

    return factory
