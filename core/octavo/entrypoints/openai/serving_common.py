"""What the completion and chat handlers share: parsing, turning prompts into engine requests
(through the engine's input processor), admission, running them (merged, or cancelled when the
client goes away) and SSE framing."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import uuid
from typing import Any, AsyncIterator, Callable, Optional, Sequence, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from octavo.engine.async_engine import AsyncEngine, EngineDeadError
from octavo.entrypoints.openai.errors import (
    OpenAIError,
    bad_request,
    from_validation_errors,
    from_value_error,
)
from octavo.entrypoints.openai.protocol import SAMPLING_FIELDS, UsageInfo, dump
from octavo.errors import ConfigError, RequestError
from octavo.inputs import (
    ProcessedPrompt,
    ProcessedRequest,
    PromptError,
    PromptType,
    RequestOptions,
)
from octavo.lora.request import LoRARequest
from octavo.outputs import RequestOutput
from octavo.sampling_params import SamplingParams

logger = logging.getLogger("octavo.entrypoints.openai")

ModelT = TypeVar("ModelT", bound=BaseModel)
MIN_LOGPROB = -9999.0  # JSON has no -inf


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """Settings of the HTTP layer (the engine's are EngineArgs)."""

    served_model_name: str
    model_path: Optional[str] = None
    api_key: Optional[str] = None
    max_queue_len: Optional[int] = None  # None: no limit
    log_requests: bool = True
    chat_template: Optional[str] = None
    ready_timeout: float = 10.0
    retry_after_s: int = 1
    tool_call_parser: Optional[str] = None  # a name from the octavo_tool_parsers hook
    enable_auto_tool_choice: bool = False  # tool_choice "auto" (needs tool_call_parser)
    allow_runtime_lora_updating: bool = False  # /v1/load_lora_adapter, /v1/unload_lora_adapter


class ClientGone(Exception):
    """The client disconnected before its response was ready."""


class Admission:
    """Room reserved for one HTTP request's engine requests; ``release`` may be called twice."""

    def __init__(self, ctx: "ServingContext", num_requests: int) -> None:
        self._ctx = ctx
        self._num_requests = num_requests

    def release(self) -> None:
        """Give the room back (once)."""
        self._ctx.num_admitted -= self._num_requests
        self._num_requests = 0


class ServingContext:
    """The engine, its tokenizer and limits, and the server's admission count."""

    def __init__(self, engine: AsyncEngine, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        self.tokenizer = engine.engine.tokenizer
        self.input_processor = engine.engine.input_processor
        self.max_model_len = engine.engine.model_config.max_model_len
        self.sampling_defaults = engine.engine.sampling_defaults
        self.lora_registry = engine.engine.lora_registry
        self.capacity = (
            None
            if config.max_queue_len is None
            else engine.engine.args.max_num_seqs + config.max_queue_len
        )
        self.num_admitted = 0
        self.tool_parser = _tool_parser(engine, config)

    # --- checks ---------------------------------------------------------------------------------

    @staticmethod
    def parse(model_cls: type[ModelT], body: bytes) -> ModelT:
        """A request body parsed into ``model_cls``, or a 400."""
        try:
            return model_cls.model_validate_json(body)
        except ValidationError as exc:
            raise from_validation_errors(exc.errors()) from None

    def check_model(self, name: Optional[str]) -> Optional[LoRARequest]:
        """The LoRA adapter ``name`` names (None: the base model), or a 404 for a model this
        server does not serve."""
        if name is None or name == self.config.served_model_name:
            return None
        lora = self.lora_registry.get(name)
        if lora is not None:
            return lora
        adapters = sorted(self.lora_registry.adapters)
        served = repr(self.config.served_model_name) + (
            f" and the LoRA adapters {', '.join(map(repr, adapters))}" if adapters else ""
        )
        raise OpenAIError(
            f"the model {name!r} does not exist; this server serves {served}",
            404,
            param="model",
            code="model_not_found",
        )

    def response_model(self, name: Optional[str]) -> str:
        """The ``model`` a response names: the adapter asked for, else the base model."""
        return name if name is not None else self.config.served_model_name

    def process_prompt(self, prompt: PromptType, field: str) -> ProcessedPrompt:
        """``prompt`` tokenised and checked by the engine's input processor (the one place a
        prompt is), or a 400 naming ``field``."""
        try:
            return self.input_processor.process_prompt(prompt, field)
        except PromptError as exc:
            raise bad_request(str(exc), param=field, code=exc.code) from None

    @staticmethod
    def options(
        body: Any,
        param_error: Callable[[ValueError], OpenAIError],
        lora_request: Optional[LoRARequest] = None,
    ) -> RequestOptions:
        """The body's per-request options (with the adapter its ``model`` named), or a 400
        from ``param_error``."""
        try:
            return RequestOptions(
                priority=body.priority, cache_salt=body.cache_salt, lora_request=lora_request
            )
        except ValueError as exc:
            raise param_error(exc) from None

    def process(
        self,
        request_id: str,
        prompt: ProcessedPrompt,
        params: SamplingParams,
        options: RequestOptions,
        param_error: Callable[[ValueError], OpenAIError],
    ) -> ProcessedRequest:
        """One engine request (its params checked against the model), or a 400 from
        ``param_error``."""
        try:
            return self.input_processor.process(request_id, prompt, params, options)
        except ValueError as exc:
            raise param_error(exc) from None

    def check_max_tokens(
        self, num_prompt_tokens: int, max_tokens: Optional[int], param: str, max_tokens_param: str
    ) -> None:
        """400 when the prompt plus ``max_tokens`` does not fit the context (vLLM's server
        refuses it; the offline API caps the output at the context instead)."""
        limit = self.max_model_len
        if max_tokens is not None and num_prompt_tokens + max_tokens > limit:
            raise bad_request(
                f"this model's context is {limit} tokens; you asked for "
                f"{num_prompt_tokens + max_tokens} ({num_prompt_tokens} in the {param}, "
                f"{max_tokens} to generate); lower {max_tokens_param} to at most "
                f"{limit - num_prompt_tokens}",
                param=max_tokens_param,
                code="context_length_exceeded",
            )

    def admit(self, num_requests: int) -> "Admission":
        """Reserve room for ``num_requests`` engine requests, or 503 when the queue is full."""
        if not self.engine.is_alive:
            raise OpenAIError(self.engine.dead_reason, 503, code="engine_dead")
        if self.capacity is not None and self.num_admitted + num_requests > self.capacity:
            raise OpenAIError(
                f"the server is at capacity ({self.num_admitted} requests in flight, "
                f"limit {self.capacity}); retry later",
                503,
                code="queue_full",
                headers={"Retry-After": str(self.config.retry_after_s)},
            )
        self.num_admitted += num_requests
        return Admission(self, num_requests)

    # --- running --------------------------------------------------------------------------------

    def start(
        self, request_id: str, requests: Sequence[ProcessedRequest]
    ) -> list[AsyncIterator[RequestOutput]]:
        """One output stream per engine request of the HTTP request ``request_id``; nothing is
        sent until iterated."""
        if self.config.log_requests and requests:
            logger.info(
                "request %s: %d prompt(s) of %s tokens, %s",
                request_id,
                len(requests),
                [len(r.prompt.token_ids) for r in requests],
                requests[0].params,
            )
        return [self.engine.generate(request) for request in requests]

    async def collect(
        self, raw_request: Request, generators: list[AsyncIterator[RequestOutput]]
    ) -> list[RequestOutput]:
        """The final output of each generator; cancels them all if the client disconnects."""

        async def run() -> list[RequestOutput]:
            finals: list[Any] = [None] * len(generators)
            async with contextlib.aclosing(merge_outputs(generators)) as outputs:
                async for index, output in outputs:
                    finals[index] = output
            return finals

        task = asyncio.ensure_future(run())
        watcher = asyncio.ensure_future(wait_for_disconnect(raw_request))
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            watcher.cancel()
            return engine_errors_as_openai(task)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise ClientGone()


def _tool_parser(engine: AsyncEngine, config: ServerConfig) -> Any:
    """The server's tool parser (None without ``tool_call_parser``), or ConfigError."""
    if config.tool_call_parser is None:
        if config.enable_auto_tool_choice:
            raise ConfigError(
                "--enable-auto-tool-choice needs --tool-call-parser NAME to read the calls"
            )
        return None
    parsers = engine.engine.core.platform.tool_parsers()
    if config.tool_call_parser not in parsers:
        raise ConfigError(
            f"--tool-call-parser {config.tool_call_parser!r} is not installed; "
            f"use one of: {', '.join(sorted(parsers))}"
        )
    return parsers[config.tool_call_parser]()


def engine_errors_as_openai(task: asyncio.Future) -> Any:
    """The task's result, with engine failures turned into OpenAI errors."""
    try:
        return task.result()
    except EngineDeadError as exc:
        raise OpenAIError(str(exc), 503, code="engine_dead") from None
    except RequestError as exc:
        raise request_failed(exc) from None
    except ValueError as exc:
        raise from_value_error(exc, SAMPLING_FIELDS) from None


def request_failed(exc: RequestError) -> OpenAIError:
    """A 500 for a request the engine failed on its own (the server and other requests go on)."""
    return OpenAIError(f"the engine failed this request: {exc}", 500, code="request_failed")


async def wait_for_disconnect(raw_request: Request) -> None:
    """Return once the client has gone away (its request body must already be read)."""
    while True:
        message = await raw_request.receive()
        if message["type"] == "http.disconnect":
            return


async def merge_outputs(
    generators: list[AsyncIterator[RequestOutput]],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(index, output) from several generators as they come; closing this cancels them all."""
    if len(generators) == 1:
        async with contextlib.aclosing(generators[0]) as generator:
            async for output in generator:
                yield 0, output
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, generator: AsyncIterator[RequestOutput]) -> None:
        try:
            async with contextlib.aclosing(generator):
                async for output in generator:
                    queue.put_nowait((index, output))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((index, exc))
        queue.put_nowait((index, None))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(generators)]
    try:
        num_open = len(tasks)
        while num_open:
            index, item = await queue.get()
            if item is None:
                num_open -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


def new_request_id(prefix: str) -> str:
    """A fresh body ``id`` (engine request ids derive from it, so it must be unique)."""
    return f"{prefix}-{uuid.uuid4().hex}"


def sse(payload: Any) -> str:
    """One server-sent event carrying ``payload`` as JSON."""
    return f"data: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


async def event_stream(events: AsyncIterator[str], admission: "Admission") -> AsyncIterator[str]:
    """A streaming response's body: ``events``; then, if the engine died or the request proved
    invalid mid-stream, an OpenAI error event; then ``[DONE]``. The admission is released as
    soon as the events end, however they end."""
    try:
        async with contextlib.aclosing(events) as inner:
            async for event in inner:
                yield event
    except EngineDeadError as exc:
        yield sse(OpenAIError(str(exc), 503, code="engine_dead").body())
    except RequestError as exc:
        yield sse(request_failed(exc).body())
    except ValueError as exc:
        yield sse(from_value_error(exc, SAMPLING_FIELDS).body())
    finally:
        admission.release()
    yield SSE_DONE


def usage_event(head: dict, prompt_tokens: int, completion_tokens: int) -> str:
    """The final chunk of a stream with ``stream_options.include_usage``: no choices, the usage."""
    usage = UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )
    return sse({**head, "choices": [], "usage": dump(usage)})


def clamp_logprob(value: float) -> float:
    """A logprob JSON can carry (-inf becomes MIN_LOGPROB)."""
    return max(value, MIN_LOGPROB)
