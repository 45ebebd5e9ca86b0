"""The offline API: ``LLM(model).generate(prompts, SamplingParams(...))``, ``chat``,
``beam_search``."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence, Union

from tqdm.auto import tqdm

from octavo.config import EngineArgs
from octavo.engine.llm_engine import LLMEngine
from octavo.entrypoints.beam_search import BeamSearchOutput, BeamSearchParams, beam_search_one
from octavo.inputs import PromptType, RequestOptions, TokensPrompt
from octavo.lora.request import LoRARequest
from octavo.model_executor.tokenizer import hf_tokenizer
from octavo.outputs import RequestOutput
from octavo.sampling_params import RequestOutputKind, SamplingParams


class LLM:
    """Generate offline with continuous batching over a local HuggingFace model folder.

    Keyword arguments are vLLM's engine arguments (``max_num_seqs``, ``block_size``,
    ``enable_prefix_caching``, ``kv_cache_memory``, ``preemption_mode``, ...).
    """

    def __init__(self, model: str, **engine_args: Any):
        self.engine = LLMEngine(EngineArgs(model=model, **engine_args))

    def shutdown(self) -> None:
        """Stop what the engine started (tensor-parallel workers; garbage collection and
        interpreter exit do it too). The LLM cannot generate afterwards."""
        self.engine.core.shutdown()

    def get_tokenizer(self):
        """The model's transformers tokenizer (imported and loaded on the first call)."""
        return hf_tokenizer(self.engine.tokenizer)

    def generate(
        self,
        prompts: Union[PromptType, Sequence[PromptType]],
        sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
        *,
        use_tqdm: bool = True,
        priority: Optional[Sequence[int]] = None,
        lora_request: Union[None, LoRARequest, Sequence[Optional[LoRARequest]]] = None,
    ) -> list[RequestOutput]:
        """Complete every prompt (text, token ids, or dicts); outputs come back in prompt order.
        ``lora_request``: one adapter for every prompt, or one (or None) per prompt (needs
        ``enable_lora=True``)."""
        prompts = self._as_list(prompts)
        params_list = self._params_list(sampling_params, len(prompts))
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(
                f"priority has {len(priority)} entries for {len(prompts)} prompts; "
                "give one per prompt"
            )
        loras = self._lora_list(lora_request, len(prompts))
        # Every prompt is processed before any is queued: one bad prompt refuses the call and
        # leaves nothing of it behind in the engine.
        requests = []
        for i, (prompt, params) in enumerate(zip(prompts, params_list)):
            params = dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
            options = RequestOptions(
                priority=0 if priority is None else priority[i], lora_request=loras[i]
            )
            self.engine.lora_registry.check(loras[i])
            request_id = self.engine.next_request_id()
            requests.append(
                self.engine.input_processor.process(request_id, prompt, params, options)
            )
        for request in requests:
            self.engine.add_processed_request(request)
        return self._run([request.request_id for request in requests], use_tqdm)

    def chat(
        self,
        messages: Union[list[dict], list[list[dict]]],
        sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
        *,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: Optional[str] = None,
        tools: Optional[list[dict]] = None,
    ) -> list[RequestOutput]:
        """Generate replies to conversations, rendered with the tokenizer's chat template
        (``tools``: OpenAI's function entries, for the template to show the model; to
        constrain the output to calls, serve it and send ``tool_choice``)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.engine.tokenizer
        prompts = []
        for conversation in conversations:
            if not conversation:
                raise ValueError("messages is empty; give at least one message")
            try:
                text = tokenizer.apply_chat_template(
                    conversation,
                    add_generation_prompt=add_generation_prompt,
                    chat_template=chat_template,
                    tools=tools,
                    tokenize=False,
                )
            except ValueError as exc:
                raise ValueError(f"cannot render the chat template: {exc}") from exc
            # The template writes its own special tokens (BOS included), so add none here.
            token_ids = tokenizer.encode(text, add_special_tokens=False)
            prompts.append(TokensPrompt(prompt_token_ids=token_ids, prompt=text))
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def beam_search(
        self, prompts: Union[PromptType, Sequence[PromptType]], params: BeamSearchParams
    ) -> list[BeamSearchOutput]:
        """The ``params.beam_width`` best continuations of each prompt (deterministic)."""
        inputs = self.engine.input_processor
        return [
            beam_search_one(self, list(inputs.process_prompt(prompt).token_ids), params)
            for prompt in self._as_list(prompts)
        ]

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        bar.update(1)
        return [finished[request_id] for request_id in request_ids]

    @staticmethod
    def _as_list(prompts) -> list:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        prompts = list(prompts)
        if prompts and all(isinstance(t, int) for t in prompts):
            return [prompts]  # one prompt of token ids
        if not prompts:
            raise ValueError("no prompts given")
        return prompts

    def get_default_sampling_params(self) -> SamplingParams:
        """The SamplingParams ``generate`` uses when given none: the library defaults,
        or the model's generation_config.json recommendations
        (``generation_config="auto"``, the default)."""
        return SamplingParams(**self.engine.sampling_defaults)

    @staticmethod
    def _lora_list(lora_request, num_prompts: int) -> list[Optional[LoRARequest]]:
        if lora_request is None or isinstance(lora_request, LoRARequest):
            return [lora_request] * num_prompts
        loras = list(lora_request)
        if len(loras) != num_prompts:
            raise ValueError(
                f"got {len(loras)} LoRA requests for {num_prompts} prompts; "
                "give one, or one (or None) per prompt"
            )
        return loras

    def _params_list(self, sampling_params, num_prompts: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [self.get_default_sampling_params()] * num_prompts
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * num_prompts
        params = list(sampling_params)
        if len(params) != num_prompts:
            raise ValueError(
                f"got {len(params)} SamplingParams for {num_prompts} prompts; "
                "give one, or one per prompt"
            )
        return params
