"""The OpenAI-compatible FastAPI app over an AsyncEngine: routes, error handling, lifespan."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from typing import AsyncIterator, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

import octavo
from octavo.engine.async_engine import AsyncEngine, EngineDeadError
from octavo.entrypoints.openai.chat_protocol import ChatCompletionRequest, ChatCompletionResponse
from octavo.entrypoints.openai.errors import OpenAIError, from_validation_errors
from octavo.entrypoints.openai.middleware import ApiKeyMiddleware, RequestIdMiddleware
from octavo.entrypoints.openai.openapi import (
    DetokenizeResponse,
    TokenizeResponse,
    error_responses,
    json_route,
    publish_schemas,
)
from octavo.entrypoints.openai.protocol import (
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
    dump,
)
from octavo.entrypoints.openai.serving_chat import create_chat_completion
from octavo.entrypoints.openai.serving_common import ServerConfig, ServingContext
from octavo.entrypoints.openai.serving_completion import create_completion
from octavo.entrypoints.openai.serving_lora import (
    adapter_cards,
    load_lora_adapter,
    unload_lora_adapter,
)
from octavo.entrypoints.openai.serving_tokenize import detokenize, tokenize
from octavo.inputs import TokensPrompt
from octavo.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("octavo.entrypoints.openai")


def build_app(engine: AsyncEngine, config: ServerConfig) -> FastAPI:
    """The app; its lifespan starts the engine thread on the serving loop and stops it after."""
    ctx = ServingContext(engine, config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="octavo", version=octavo.__version__, lifespan=lifespan, redoc_url=None)
    app.state.serving = ctx
    _add_error_handlers(app)
    _add_health_routes(app, ctx)
    _add_api_routes(app, ctx)
    if config.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key)
    app.add_middleware(RequestIdMiddleware)  # added last: outermost, so every response has the id
    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def openai_error(_: Request, exc: OpenAIError) -> Response:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> Response:
        return from_validation_errors(list(exc.errors())).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> Response:
        return OpenAIError(str(exc.detail), exc.status_code, code=None).response()

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> Response:
        logger.exception("internal error while serving a request")
        return OpenAIError(f"internal error: {type(exc).__name__}: {exc}", 500).response()


def _add_health_routes(app: FastAPI, ctx: ServingContext) -> None:
    engine = ctx.engine

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_alive:
            return OpenAIError(engine.dead_reason, 503, code="engine_dead").response()
        return JSONResponse({"status": "ok"})

    @app.get("/health/ready")
    async def ready() -> Response:
        start = time.perf_counter()
        try:
            await asyncio.wait_for(_one_token(ctx), ctx.config.ready_timeout)
        except asyncio.TimeoutError:
            message = f"the engine produced no token within {ctx.config.ready_timeout} s"
            return OpenAIError(message, 503, code="not_ready").response()
        except EngineDeadError as exc:
            return OpenAIError(str(exc), 503, code="engine_dead").response()
        return JSONResponse({"status": "ready", "latency_s": round(time.perf_counter() - start, 4)})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": octavo.__version__})


async def _one_token(ctx: ServingContext) -> None:
    """Generate one greedy token (not counted in the request metrics)."""
    bos = getattr(ctx.tokenizer, "bos_token_id", None)
    prompt = TokensPrompt(prompt_token_ids=[bos if bos is not None else 0])
    params = SamplingParams(max_tokens=1, temperature=0.0, output_kind=RequestOutputKind.FINAL_ONLY)
    request = ctx.input_processor.process(f"ready-{uuid.uuid4().hex}", prompt, params)
    async for _ in ctx.engine.generate(request, record_metrics=False):
        pass


def _add_api_routes(app: FastAPI, ctx: ServingContext) -> None:
    def counted(handler: Callable[[ServingContext, Request], Awaitable[Response]]):
        async def route(raw_request: Request) -> Response:
            try:
                return await handler(ctx, raw_request)
            except OpenAIError as exc:
                if exc.code == "queue_full":
                    ctx.engine.metrics.on_request_refused("rejected")
                elif exc.status_code < 500:  # 5xx: the engine counted the request as failed
                    ctx.engine.metrics.on_request_refused("invalid")
                raise

        # The handler's name and docstring title the route in /openapi.json (not its signature:
        # FastAPI must see only the raw request).
        route.__name__, route.__doc__ = handler.__name__, handler.__doc__
        return route

    generation = dict(streams=True, errors=(400, 401, 404, 500, 503))
    completions_docs = json_route(CompletionRequest, CompletionResponse, **generation)
    chat_docs = json_route(ChatCompletionRequest, ChatCompletionResponse, **generation)
    app.post("/v1/completions", **completions_docs)(counted(create_completion))
    app.post("/v1/chat/completions", **chat_docs)(counted(create_chat_completion))
    publish_schemas(
        app,
        (
            CompletionRequest,
            ChatCompletionRequest,
            TokenizeRequest,
            DetokenizeRequest,
            LoadLoRAAdapterRequest,
            UnloadLoRAAdapterRequest,
        ),
    )

    @app.get("/v1/models", responses={200: {"model": ModelList}, **error_responses(401)})
    async def models() -> Response:
        return JSONResponse(dump(ModelList(data=[_model_card(ctx), *adapter_cards(ctx)])))

    model_docs = {200: {"model": ModelCard}, **error_responses(401, 404)}

    @app.get("/v1/models/{model_id:path}", responses=model_docs)
    async def model(model_id: str) -> Response:
        if ctx.check_model(model_id) is not None:
            (card,) = [c for c in adapter_cards(ctx) if c.id == model_id]
            return JSONResponse(dump(card))
        return JSONResponse(dump(_model_card(ctx)))

    lora_docs = dict(errors=(400, 401, 404))
    app.post("/v1/load_lora_adapter", **json_route(LoadLoRAAdapterRequest, None, **lora_docs))(
        counted(load_lora_adapter)
    )
    app.post("/v1/unload_lora_adapter", **json_route(UnloadLoRAAdapterRequest, None, **lora_docs))(
        counted(unload_lora_adapter)
    )

    @app.post("/tokenize", **json_route(TokenizeRequest, TokenizeResponse))
    async def tokenize_route(raw_request: Request) -> Response:
        return await tokenize(ctx, raw_request)

    @app.post("/detokenize", **json_route(DetokenizeRequest, DetokenizeResponse))
    async def detokenize_route(raw_request: Request) -> Response:
        return await detokenize(ctx, raw_request)


def _model_card(ctx: ServingContext) -> ModelCard:
    return ModelCard(
        id=ctx.config.served_model_name, root=ctx.config.model_path, max_model_len=ctx.max_model_len
    )
