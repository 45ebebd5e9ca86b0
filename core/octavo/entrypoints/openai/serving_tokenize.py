"""POST /tokenize and /detokenize, with the tokenizer and chat template the server
generates with."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from octavo.entrypoints.openai.chat_protocol import ChatCompletionRequest
from octavo.entrypoints.openai.errors import bad_request, from_validation_errors
from octavo.entrypoints.openai.protocol import DetokenizeRequest, TokenizeRequest
from octavo.entrypoints.openai.serving_chat import render_chat
from octavo.entrypoints.openai.serving_common import ServingContext
from octavo.inputs import PromptError


async def tokenize(ctx: ServingContext, raw_request: Request) -> Response:
    """``{"prompt": text}`` or ``{"messages": [...]}``
    -> ``{"tokens", "count", "max_model_len"}``."""
    body = ctx.parse(TokenizeRequest, await raw_request.body())
    ctx.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give exactly one of prompt or messages", param="prompt")
    if body.prompt is not None:
        tokens = ctx.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    else:
        try:
            chat = ChatCompletionRequest.model_validate(
                {"messages": body.messages, "tools": body.tools}
            )
            conversation = chat.conversation()
        except ValidationError as exc:
            raise from_validation_errors(exc.errors()) from None
        except ValueError as exc:
            raise bad_request(str(exc), param="messages") from None
        tokens = render_chat(
            ctx, conversation, body.add_generation_prompt, template_kwargs=chat.template_kwargs()
        )
    return JSONResponse(
        {"tokens": list(tokens), "count": len(tokens), "max_model_len": ctx.max_model_len}
    )


async def detokenize(ctx: ServingContext, raw_request: Request) -> Response:
    """``{"tokens": [...]}`` -> ``{"prompt": text}``."""
    body = ctx.parse(DetokenizeRequest, await raw_request.body())
    ctx.check_model(body.model)
    try:
        ctx.input_processor.check_token_ids(body.tokens, "tokens")
    except PromptError as exc:
        raise bad_request(str(exc), param="tokens") from None
    return JSONResponse({"prompt": ctx.tokenizer.decode(body.tokens)})
