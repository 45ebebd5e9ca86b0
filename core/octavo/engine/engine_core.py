"""EngineCore: schedule -> execute -> update, one step at a time, on one platform."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Iterable, Optional

from octavo.config import EngineArgs
from octavo.distributed.executor import MultiprocExecutor
from octavo.engine.core_output import EngineCoreOutput
from octavo.errors import ConfigError, RequestError
from octavo.inputs import RequestOptions
from octavo.kv_cache.manager import KVCacheManager
from octavo.model_executor.batch_runner import RunnerConfig
from octavo.model_executor.model_config import ModelConfig
from octavo.model_executor.model_runner import ModelRunner
from octavo.model_executor.runner_output import ModelRunnerOutput
from octavo.outputs.types import FinishReason
from octavo.platform.facade import Platform
from octavo.request import Request, RequestStatus
from octavo.sampling_params import SamplingParams
from octavo.sched.scheduler import Scheduler
from octavo.spec_decode.policy import SpeculationPolicy
from octavo.spec_decode.stats import SpecDecodeLog

logger = logging.getLogger(__name__)


def resolve_engine(
    args: EngineArgs, platform: Platform
) -> tuple[EngineArgs, ModelConfig, RunnerConfig]:
    """The arguments with the platform's settings applied, the model's config and the runner's,
    as every node of a tensor-parallel run resolves them."""
    overrides = platform.configure(args)
    args = dataclasses.replace(args, **overrides) if overrides else args
    model_config = ModelConfig.from_folder(
        args.model,
        dtype=args.dtype,
        supported_dtypes=platform.capabilities.dtypes,
        platform_name=platform.name,
        max_model_len=args.max_model_len,
    )
    runner_config = RunnerConfig(
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        quantization=args.quantization,
        speculative_config=args.speculative_config,
        enforce_eager=args.enforce_eager,
        compile_cache_dir=args.compile_cache_dir,
        lora_config=args.lora_config,
    )
    return args, model_config, runner_config


class EngineCore:
    """Owns the platform, the model runner, the KV cache manager and the scheduler."""

    def __init__(self, args: EngineArgs, platform: Optional[Platform] = None):
        if args.model is None:
            raise ValueError("no model given: pass the path of a local HuggingFace model folder")
        self.platform = platform if platform is not None else Platform.select(args.device)
        self.args, self.model_config, runner_config = resolve_engine(args, self.platform)
        max_model_len = self.model_config.max_model_len
        self.scheduler_config = self.args.scheduler_config(max_model_len)
        if (
            not self.scheduler_config.enable_chunked_prefill
            and self.args.max_num_batched_tokens < max_model_len
        ):
            raise ValueError(
                "with chunked prefill off, max_num_batched_tokens "
                f"({self.args.max_num_batched_tokens}) must be "
                f">= max_model_len ({max_model_len}) so any prompt fits one step; "
                "raise it or lower --max-model-len"
            )
        self.runner = self._build_runner(runner_config)
        try:
            self._init_cache_and_scheduler()
        except BaseException:
            self.runner.shutdown()  # no worker outlives a failed start-up
            raise

    def _init_cache_and_scheduler(self) -> None:
        self.sizing = self.runner.plan_kv_cache(self.args.cache_config)
        logger.info(
            "KV cache: %d blocks of %d tokens (%d host blocks)",
            self.sizing.num_gpu_blocks,
            self.sizing.block_size,
            self.sizing.num_host_blocks,
        )
        num_host_blocks = self.sizing.num_host_blocks if self.args.preemption_mode == "swap" else 0
        self.runner.initialize_kv_cache(self.sizing.num_gpu_blocks, num_host_blocks)
        self.kv_cache_manager = KVCacheManager(
            self.sizing.num_gpu_blocks,
            self.sizing.block_size,
            enable_caching=self.args.enable_prefix_caching,
            hash_algo=self.args.prefix_caching_hash_algo,
            num_host_blocks=num_host_blocks,
            recompute_last_cached_block=self.runner.recompute_last_cached_block,
        )
        spec = self.args.speculative_config
        self.spec_policy = SpeculationPolicy() if spec is not None and spec.adaptive else None
        self.scheduler = Scheduler(self.scheduler_config, self.kv_cache_manager, self.spec_policy)
        self.spec_log = (
            SpecDecodeLog(self.scheduler.spec_stats) if self.args.speculative_config else None
        )

    def _build_runner(self, runner_config: RunnerConfig):
        """The platform's own runner (``octavo_model_runner``), else the torch model runner in
        this process, or with tensor parallelism this node's ranks as worker processes
        (:class:`MultiprocExecutor`), which answer the same calls."""
        parallel = self.args.parallel_config
        own_runner = self.platform.model_runner(runner_config)
        if own_runner is not None:
            if runner_config.lora_config is not None:
                raise ConfigError(
                    f"platform {self.platform.name!r} runs the model with its own runner, "
                    "which serves no LoRA adapters yet: drop --enable-lora"
                )
            if parallel.tensor_parallel_size > 1:
                raise ConfigError(
                    f"platform {self.platform.name!r} runs the model with its own runner, "
                    "which does not shard it yet: use --tensor-parallel-size 1"
                )
            return own_runner(self.model_config, self.platform, runner_config)
        if parallel.tensor_parallel_size == 1:
            return ModelRunner(self.model_config, self.platform, runner_config)
        if parallel.node_rank != 0:
            raise ConfigError(
                f"node {parallel.node_rank} runs tensor-parallel workers only: start it with "
                "`octavo serve ... --node-rank N` (node 0 runs the engine)"
            )
        return MultiprocExecutor(
            self.model_config,
            runner_config,
            parallel,
            device=self.platform.name,
            seed=self.args.seed,
        )

    def check_alive(self) -> Optional[str]:
        """Why this engine cannot step any more (a tensor-parallel worker died), or None."""
        return self.runner.check_alive()

    def shutdown(self) -> None:
        """Stop what the engine started (tensor-parallel workers); idempotent."""
        self.runner.shutdown()

    # --- requests -----------------------------------------------------------------------------

    def make_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        options: RequestOptions,
    ) -> Request:
        """A Request hashed for this engine's prefix cache. The prompt and params must come
        from the ``InputProcessor`` (checked against this model)."""
        return Request(
            request_id,
            prompt_token_ids,
            params,
            arrival_time=options.arrival_time,
            priority=options.priority,
            cache_salt=options.cache_salt,
            lora_request=options.lora_request,
            block_hasher=self.kv_cache_manager.block_hasher,
        )

    def add_request(self, request: Request, parent_id: Optional[str] = None) -> None:
        """Queue a request (the children of one ``parent_id`` fork its prompt's KV)."""
        self.scheduler.add_request(request, parent_id)

    def finish_requests(
        self, request_ids: Iterable[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED
    ) -> None:
        self.scheduler.finish_requests(request_ids, status)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # --- the step -----------------------------------------------------------------------------

    def step(self) -> list[EngineCoreOutput]:
        """Schedule, execute and update once; return each request's new tokens."""
        scheduler_output = self.scheduler.schedule()
        if (
            scheduler_output.total_num_scheduled_tokens == 0
            and not scheduler_output.finished_req_ids
        ):
            return []
        start = time.perf_counter()
        try:
            runner_output = self.runner.execute_model(scheduler_output)
        except RequestError as exc:
            return self._fail_step(exc)
        if self.spec_policy is not None:
            self.spec_policy.observe_step(
                len(scheduler_output.num_scheduled_tokens),
                scheduler_output.total_num_scheduled_tokens,
                sum(map(len, scheduler_output.scheduled_spec_token_ids.values())),
                sum(map(len, runner_output.sampled_token_ids)),
                time.perf_counter() - start,
            )
        return self._update(runner_output)

    def _fail_step(self, error: RequestError) -> list[EngineCoreOutput]:
        """The step failed before its forward pass for some requests (their set-up): end those
        with an error and restart the others, whose step never ran. (Failures after the forward
        pass come back in ``ModelRunnerOutput.failed``: the other rows' tokens stand.)"""
        failed = [r for r in error.request_ids if r in self.scheduler.requests]
        if not failed:
            raise error  # blames no request of this engine: restarting would fail the same way
        logger.warning(
            "a step failed for request(s) %s; the others restart", failed, exc_info=error
        )
        self.scheduler.finish_requests(failed, RequestStatus.FINISHED_ERROR)
        self.scheduler.restart_after_failed_step()
        return [
            EngineCoreOutput(r, finish_reason=FinishReason.ERROR, error=error.messages[r])
            for r in failed
        ]

    def _update(self, runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        sampled: dict[str, list[int]] = {}
        outputs = []
        for req_id, token_ids, logprobs in zip(
            runner_output.req_ids, runner_output.sampled_token_ids, runner_output.logprobs
        ):
            if token_ids:
                sampled[req_id] = token_ids
                outputs.append(EngineCoreOutput(req_id, token_ids, logprobs))
        if runner_output.failed:
            self.scheduler.finish_requests(runner_output.failed, RequestStatus.FINISHED_ERROR)
            outputs += [
                EngineCoreOutput(r, finish_reason=FinishReason.ERROR, error=message)
                for r, message in runner_output.failed.items()
            ]
        self.scheduler.update_from_output(sampled, runner_output.spec_token_ids)
        if self.spec_log is not None:
            self.spec_log.maybe_log()
        return outputs
