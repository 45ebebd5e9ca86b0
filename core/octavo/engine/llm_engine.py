"""LLMEngine: the synchronous engine: process inputs, add requests, step, build RequestOutputs."""

from __future__ import annotations

import itertools
import logging
from typing import Iterable, Optional, Union

from octavo.config import EngineArgs
from octavo.engine.engine_core import EngineCore
from octavo.inputs import InputProcessor, ProcessedRequest, PromptType, RequestOptions
from octavo.lora.registry import LoRARegistry
from octavo.lora.request import LoRARequest
from octavo.model_executor.tokenizer import check_vocabulary, load_tokenizer
from octavo.outputs import RequestOutput
from octavo.outputs.processor import OutputProcessor
from octavo.platform.facade import Platform
from octavo.request import RequestStatus
from octavo.sampling_defaults import load_sampling_defaults
from octavo.sampling_params import SamplingParams
from octavo.structured_output.backend import LazyGrammarBackend

logger = logging.getLogger("octavo.engine")


class LLMEngine:
    """An engine core with its input processor (tokenizer included) and output processor,
    driven by ``step()``."""

    def __init__(self, args: EngineArgs, platform: Optional[Platform] = None):
        self.core = EngineCore(args, platform)
        self.args = self.core.args
        self.model_config = self.core.model_config
        self.tokenizer = load_tokenizer(self.args.tokenizer or self.args.model)
        mc = self.model_config
        if self.args.tokenizer is not None:  # another folder's: is it this model's?
            check_vocabulary(self.tokenizer, mc.vocab_size, self.args.tokenizer)
        self.grammar_backend = LazyGrammarBackend(
            self.tokenizer,
            mc.vocab_size,
            mc.eos_token_ids,
            any_whitespace=not self.args.structured_outputs_config["disable_any_whitespace"],
        )
        self.core.runner.enable_structured_output(self.grammar_backend)
        self.input_processor = InputProcessor(
            self.tokenizer, mc.vocab_size, mc.max_model_len, mc.eos_token_ids, self.grammar_backend
        )
        eos = (
            self.model_config.eos_token_ids[0]
            if self.model_config.eos_token_ids
            else self.tokenizer.eos_token_id
        )
        self.output_processor = OutputProcessor(
            self.tokenizer, eos, self.model_config.max_model_len
        )
        self.sampling_defaults = load_sampling_defaults(
            self.args.generation_config,
            self.model_config.generation_config,
            self.args.override_generation_config,
        )
        if self.sampling_defaults:
            logger.info(
                "requests that leave them unset get the generation config's %s "
                "(--generation-config vllm ignores it)",
                self.sampling_defaults,
            )
        self.lora_registry = LoRARegistry(self.model_config, self.args.lora_config)
        self._ids = itertools.count()

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        return cls(args)

    def next_request_id(self) -> str:
        return str(next(self._ids))

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        *,
        priority: int = 0,
        cache_salt: Optional[str] = None,
        arrival_time: Optional[float] = None,
        lora_request: Optional[LoRARequest] = None,
    ) -> None:
        """Validate and queue one user request (its ``n`` samples fork one prompt)."""
        options = RequestOptions(priority, cache_salt, arrival_time, lora_request)
        self.add_processed_request(
            self.input_processor.process(request_id, prompt, params, options)
        )

    def add_processed_request(self, request: ProcessedRequest) -> None:
        """Queue a request the input processor has already tokenised and checked (and its
        LoRA adapter, here, against the base model)."""
        token_ids, options = request.prompt.token_ids, request.options
        self.lora_registry.check(options.lora_request)
        children = self.output_processor.add_request(
            request.request_id,
            token_ids,
            request.params,
            prompt=request.prompt.text,
            arrival_time=options.arrival_time,
        )
        requests = [
            self.core.make_request(child.request_id, token_ids, child.sampling_params, options)
            for child in children
        ]
        parent_id = request.request_id if len(children) > 1 else None
        for engine_request in requests:
            self.core.add_request(engine_request, parent_id)

    def abort_request(self, request_ids: Union[str, Iterable[str]]) -> list[RequestOutput]:
        """Abort user requests; returns their final outputs (finish_reason "abort")."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        processed = self.output_processor.abort_requests(ids)
        self.core.finish_requests(processed.reqs_aborted, RequestStatus.FINISHED_ABORTED)
        return processed.request_outputs

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """One engine step; returns the outputs of the requests it advanced."""
        processed = self.output_processor.process_outputs(self.core.step())
        if processed.reqs_finished:
            self.core.finish_requests(processed.reqs_finished, RequestStatus.FINISHED_STOPPED)
        if processed.reqs_aborted:
            self.core.finish_requests(processed.reqs_aborted, RequestStatus.FINISHED_ABORTED)
        if processed.reqs_failed:
            self.core.finish_requests(processed.reqs_failed, RequestStatus.FINISHED_ERROR)
        return processed.request_outputs
