"""POST /v1/chat/completions: messages rendered with the model's chat template, streamed or not."""

from __future__ import annotations

import contextlib
import functools
import time
from typing import AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from octavo.entrypoints.openai.chat_protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobEntry,
    ChatLogprobs,
    ChatLogprobToken,
    ChatResponseMessage,
)
from octavo.entrypoints.openai.errors import OpenAIError, bad_request, from_value_error
from octavo.entrypoints.openai.protocol import SAMPLING_FIELDS, UsageInfo, dump
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
from octavo.entrypoints.openai.serving_tools import ToolCalling, finish_reason, tool_calling
from octavo.entrypoints.openai.structured import constrain, constraint_of
from octavo.inputs import TokensPrompt
from octavo.outputs import Logprob, SampleLogprobs
from octavo.sampling_params import SamplingParams
from octavo.tool_parsers import ToolCallStream


def render_chat(
    ctx: ServingContext,
    conversation: list[dict],
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    template_kwargs: Optional[dict] = None,
) -> list[int]:
    """The conversation's prompt token ids through the chat template
    (the server's, else the model's)."""
    template = ctx.config.chat_template
    if template is None and getattr(ctx.tokenizer, "chat_template", None) is None:
        raise bad_request(
            "this model has no chat template; start the server with --chat-template FILE",
            param="messages",
        )
    try:
        rendered = ctx.tokenizer.apply_chat_template(
            conversation,
            chat_template=template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tokenize=True,
            **(template_kwargs or {}),
        )
    except Exception as exc:  # noqa: BLE001 - jinja2 and transformers raise many types; all are the request's
        raise bad_request(f"cannot render the chat template: {exc}", param="messages") from None
    token_ids = rendered["input_ids"] if hasattr(rendered, "keys") else rendered
    return list(token_ids)


def _param_error(exc: ValueError, body: ChatCompletionRequest) -> OpenAIError:
    """A 400 naming the body field at fault (message errors name ``messages``)."""
    error = from_value_error(
        exc,
        SAMPLING_FIELDS | {"role", "content", "messages", "top_logprobs", "cache_salt", "priority"},
    )
    if error.param in ("role", "content"):
        error.param = "messages"
    elif error.param == "max_tokens" and body.max_completion_tokens is not None:
        error.param = "max_completion_tokens"
    elif error.param == "logprobs" and body.top_logprobs is not None:
        error.param = "top_logprobs"
    return error


async def _constrain(
    ctx: ServingContext, params: SamplingParams, body: ChatCompletionRequest
) -> tuple[SamplingParams, ToolCalling]:
    """``(params with the output constraint, the request's tool calling)``: a constraint comes
    from the body's fields or from its tools, not both."""
    constraint, field = constraint_of(body)
    tools = tool_calling(
        body,
        ctx.tool_parser,
        ctx.config.enable_auto_tool_choice,
        ctx.engine.engine.grammar_backend.any_whitespace,
    )
    if tools.constraint is not None:
        if constraint is not None:
            raise bad_request(
                f"{field} cannot be combined with tool calls (tool_choice constrains the "
                'output to them); drop it or send tool_choice "none"',
                param=field,
            )
        constraint, field = tools.constraint, "tools"
    return await constrain(ctx.engine.engine, params, constraint, field), tools


async def create_chat_completion(ctx: ServingContext, raw_request: Request) -> Response:
    """Handle one /v1/chat/completions request."""
    body = ctx.parse(ChatCompletionRequest, await raw_request.body())
    lora_request = ctx.check_model(body.model)
    try:
        conversation = body.conversation()
        num_logprobs = body.num_logprobs()
        max_tokens = (
            body.max_completion_tokens
            if body.max_completion_tokens is not None
            else body.max_tokens
        )
        params = body.sampling_params(max_tokens, num_logprobs, ctx.sampling_defaults)
    except ValueError as exc:
        raise _param_error(exc, body) from None
    params, tools = await _constrain(ctx, params, body)
    token_ids = render_chat(
        ctx,
        conversation,
        body.add_generation_prompt,
        body.continue_final_message,
        body.template_kwargs(),
    )
    param_error = functools.partial(_param_error, body=body)
    prompt = ctx.process_prompt(TokensPrompt(prompt_token_ids=token_ids), "messages")
    options = ctx.options(body, param_error, lora_request)
    request_id = new_request_id("chatcmpl")
    request = ctx.process(f"{request_id}-0", prompt, params, options, param_error)
    max_param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    ctx.check_max_tokens(len(token_ids), params.max_tokens, "messages", max_param)
    admission = ctx.admit(1)
    generators = ctx.start(request_id, [request])
    if body.stream:
        stream = event_stream(
            _stream(ctx, request_id, body, tools, len(token_ids), generators), admission
        )
        return StreamingResponse(
            stream, media_type="text/event-stream", background=BackgroundTask(admission.release)
        )
    try:
        (final,) = await ctx.collect(raw_request, generators)
    except ClientGone:
        return Response(status_code=499)
    finally:
        admission.release()
    return JSONResponse(dump(_response(ctx, request_id, body, tools, len(token_ids), final)))


def _response(
    ctx: ServingContext,
    request_id: str,
    body: ChatCompletionRequest,
    tools: ToolCalling,
    num_prompt_tokens: int,
    final,
) -> ChatCompletionResponse:
    choices = []
    for completion in final.outputs:
        content, tool_calls = tools.message(completion.text)
        choices.append(
            ChatChoice(
                index=completion.index,
                message=ChatResponseMessage(content=content, tool_calls=tool_calls),
                logprobs=_logprobs(completion.logprobs, body.top_logprobs or 0)
                if body.logprobs
                else None,
                finish_reason=finish_reason(completion.finish_reason, bool(tool_calls)),
                stop_reason=completion.stop_reason,
            )
        )
    num_completion_tokens = sum(len(c.token_ids) for c in final.outputs)
    usage = UsageInfo(
        prompt_tokens=num_prompt_tokens,
        completion_tokens=num_completion_tokens,
        total_tokens=num_prompt_tokens + num_completion_tokens,
    )
    return ChatCompletionResponse(
        id=request_id, model=ctx.response_model(body.model), choices=choices, usage=usage
    )


async def _stream(
    ctx: ServingContext,
    request_id: str,
    body: ChatCompletionRequest,
    tools: ToolCalling,
    num_prompt_tokens: int,
    generators: list[AsyncIterator],
) -> AsyncIterator[str]:
    # Chunks are plain dicts: one is built per token per stream, pydantic would cost more
    # than the rest.
    head = {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": ctx.response_model(body.model),
    }

    def chunk(index: int, delta: dict, finish_reason=None, stop_reason=None, logprobs=None) -> str:
        choice = {
            "index": index,
            "delta": delta,
            "logprobs": None if logprobs is None else dump(logprobs),
            "finish_reason": finish_reason,
            "stop_reason": stop_reason,
        }
        return sse({**head, "choices": [choice], "usage": None})

    num_completion_tokens = 0
    texts = [""] * body.n  # with tool calling, each choice's text so far, re-parsed per delta
    streams = [ToolCallStream() for _ in range(body.n if tools.parser is not None else 0)]
    made_calls = [False] * body.n
    for index in range(body.n):
        yield chunk(index, {"role": "assistant", "content": ""})
    async with contextlib.aclosing(merge_outputs(generators)) as outputs:
        async for _, output in outputs:
            for completion in output.outputs:
                index = completion.index
                num_completion_tokens += len(completion.token_ids)
                logprobs = (
                    _logprobs(completion.logprobs, body.top_logprobs or 0)
                    if body.logprobs
                    else None
                )
                content, calls = completion.text, []
                if streams:
                    texts[index] += completion.text
                    parsed = tools.parse(texts[index], final=completion.finish_reason is not None)
                    content, calls = streams[index].update(parsed)
                    made_calls[index] = made_calls[index] or bool(calls)
                if content or calls or (logprobs and logprobs.content):
                    delta = {"content": content} if content or not calls else {}
                    if calls:
                        delta["tool_calls"] = calls
                    yield chunk(index, delta, logprobs=logprobs)
                if completion.finish_reason is not None:
                    reason = finish_reason(completion.finish_reason, made_calls[index])
                    yield chunk(index, {}, reason, completion.stop_reason)
    if body.include_usage:
        yield usage_event(head, num_prompt_tokens, num_completion_tokens)


def _entry(logprob: Logprob) -> ChatLogprobEntry:
    token = logprob.decoded_token or ""
    return ChatLogprobEntry(
        token=token, logprob=clamp_logprob(logprob.logprob), bytes=list(token.encode("utf-8"))
    )


def _logprobs(positions: Optional[SampleLogprobs], num_top: int) -> ChatLogprobs:
    """OpenAI's chat logprobs: per token, its logprob and the ``num_top`` most likely tokens."""
    content = []
    for position in positions or ():
        chosen = next(iter(position.values()))
        top = sorted(
            (lp for lp in position.values() if lp.rank is not None and lp.rank <= num_top),
            key=lambda lp: lp.rank,
        )
        entry = _entry(chosen)
        content.append(
            ChatLogprobToken(
                token=entry.token,
                logprob=entry.logprob,
                bytes=entry.bytes,
                top_logprobs=[_entry(lp) for lp in top],
            )
        )
    return ChatLogprobs(content=content)
