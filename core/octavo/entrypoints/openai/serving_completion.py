"""POST /v1/completions: prompts as text or token ids, streamed or not, with echo and logprobs."""

from __future__ import annotations

import contextlib
import time
from typing import AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from octavo.entrypoints.openai.errors import OpenAIError, bad_request, from_value_error
from octavo.entrypoints.openai.protocol import (
    SAMPLING_FIELDS,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
    dump,
)
from octavo.entrypoints.openai.serving_common import (
    ClientGone,
    ServingContext,
    clamp_logprob,
    event_stream,
    merge_outputs,
    new_request_id,
    sse,
    usage_event,
)
from octavo.entrypoints.openai.structured import constrain, constraint_of
from octavo.inputs import ProcessedPrompt, PromptType
from octavo.outputs import CompletionOutput, SampleLogprobs


def _prompts(prompt) -> list[PromptType]:
    """The body's ``prompt`` as a list of prompts (text or token ids)."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    if not prompt:
        raise bad_request(
            "prompt is empty; give text, a list of texts, token ids or lists of token ids",
            param="prompt",
        )
    return list(prompt)


def _param_error(exc: ValueError) -> OpenAIError:
    """A 400 naming the body field at fault."""
    return from_value_error(exc, SAMPLING_FIELDS | {"cache_salt", "priority"})


def _check_unsupported(body: CompletionRequest) -> None:
    if body.suffix:
        raise bad_request("suffix is not supported", param="suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise bad_request(
            "best_of must equal n when given (no server-side best-of selection)", param="best_of"
        )
    if body.echo and body.logprobs is not None:
        raise bad_request(
            "echo with logprobs needs prompt logprobs, which this engine does not compute yet",
            param="logprobs",
        )


async def create_completion(ctx: ServingContext, raw_request: Request) -> Response:
    """Handle one /v1/completions request."""
    body = ctx.parse(CompletionRequest, await raw_request.body())
    lora_request = ctx.check_model(body.model)
    _check_unsupported(body)
    prompts = [ctx.process_prompt(prompt, "prompt") for prompt in _prompts(body.prompt)]
    try:
        params = body.sampling_params(body.max_tokens, body.logprobs, ctx.sampling_defaults)
    except ValueError as exc:
        raise _param_error(exc) from None
    params = await constrain(ctx.engine.engine, params, *constraint_of(body))
    options = ctx.options(body, _param_error, lora_request)
    request_id = new_request_id("cmpl")
    requests = [
        ctx.process(f"{request_id}-{i}", prompt, params, options, _param_error)
        for i, prompt in enumerate(prompts)
    ]
    for prompt in prompts:
        ctx.check_max_tokens(len(prompt.token_ids), params.max_tokens, "prompt", "max_tokens")
    admission = ctx.admit(len(prompts))
    generators = ctx.start(request_id, requests)
    if body.stream:
        stream = event_stream(_stream(ctx, request_id, body, prompts, generators), admission)
        return StreamingResponse(
            stream, media_type="text/event-stream", background=BackgroundTask(admission.release)
        )
    try:
        finals = await ctx.collect(raw_request, generators)
    except ClientGone:
        return Response(status_code=499)
    finally:
        admission.release()
    return JSONResponse(dump(_response(ctx, request_id, body, prompts, finals)))


def _response(
    ctx: ServingContext,
    request_id: str,
    body: CompletionRequest,
    prompts: list[ProcessedPrompt],
    finals,
) -> CompletionResponse:
    choices = []
    num_completion_tokens = 0
    for i, (prompt, final) in enumerate(zip(prompts, finals)):
        prefix = _echo_text(ctx, prompt) if body.echo else ""
        for completion in final.outputs:
            num_completion_tokens += len(completion.token_ids)
            logprobs = (
                _logprobs(completion.logprobs, body.logprobs, len(prefix))
                if body.logprobs is not None
                else None
            )
            choices.append(
                _choice(
                    i * body.n + completion.index, prefix + completion.text, logprobs, completion
                )
            )
    num_prompt_tokens = sum(len(p.token_ids) for p in prompts)
    usage = UsageInfo(
        prompt_tokens=num_prompt_tokens,
        completion_tokens=num_completion_tokens,
        total_tokens=num_prompt_tokens + num_completion_tokens,
    )
    return CompletionResponse(
        id=request_id, model=ctx.response_model(body.model), choices=choices, usage=usage
    )


async def _stream(
    ctx: ServingContext,
    request_id: str,
    body: CompletionRequest,
    prompts: list[ProcessedPrompt],
    generators: list[AsyncIterator],
) -> AsyncIterator[str]:
    # Chunks are plain dicts: one is built per token per stream, pydantic would cost more
    # than the rest.
    head = {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": ctx.response_model(body.model),
    }
    offsets: dict[int, int] = {}  # choice index -> text length sent so far
    num_completion_tokens = 0
    async with contextlib.aclosing(merge_outputs(generators)) as outputs:
        async for i, output in outputs:
            for completion in output.outputs:
                index = i * body.n + completion.index
                num_completion_tokens += len(completion.token_ids)
                text = completion.text
                if index not in offsets and body.echo:
                    text = _echo_text(ctx, prompts[i]) + text
                offset = offsets.get(index, 0)
                offsets[index] = offset + len(text)
                logprobs = (
                    _logprobs(completion.logprobs, body.logprobs, offset)
                    if body.logprobs is not None
                    else None
                )
                if (
                    not text
                    and completion.finish_reason is None
                    and not (logprobs and logprobs.tokens)
                ):
                    continue
                choice = {
                    "index": index,
                    "text": text,
                    "logprobs": None if logprobs is None else dump(logprobs),
                    "finish_reason": completion.finish_reason,
                    "stop_reason": completion.stop_reason,
                }
                yield sse({**head, "choices": [choice], "usage": None})
    if body.include_usage:
        num_prompt_tokens = sum(len(p.token_ids) for p in prompts)
        yield usage_event(head, num_prompt_tokens, num_completion_tokens)


def _choice(
    index: int, text: str, logprobs: Optional[CompletionLogprobs], completion: CompletionOutput
) -> CompletionChoice:
    return CompletionChoice(
        index=index,
        text=text,
        logprobs=logprobs,
        finish_reason=completion.finish_reason,
        stop_reason=completion.stop_reason,
    )


def _echo_text(ctx: ServingContext, prompt: ProcessedPrompt) -> str:
    if prompt.text is not None:
        return prompt.text
    return ctx.tokenizer.decode(prompt.token_ids, skip_special_tokens=True)


def _logprobs(positions: Optional[SampleLogprobs], num_top: int, offset: int) -> CompletionLogprobs:
    """OpenAI's completions logprobs: the chosen tokens, their logprobs and the top ``num_top``."""
    result = CompletionLogprobs()
    for position in positions or ():
        token_id, chosen = next(iter(position.items()))
        token = chosen.decoded_token or ""
        result.tokens.append(token)
        result.token_logprobs.append(clamp_logprob(chosen.logprob))
        result.text_offset.append(offset)
        offset += len(token)
        top = {
            lp.decoded_token or "": clamp_logprob(lp.logprob)
            for lp in position.values()
            if lp.rank is not None and lp.rank <= num_top
        }
        result.top_logprobs.append(top)
    return result
