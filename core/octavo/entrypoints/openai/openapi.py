"""The OpenAPI document of routes that parse their own request bodies.

The generation and tokenizer routes read the raw body and validate it themselves (strictly, with
OpenAI-style 400s), so FastAPI sees no body parameter and would publish none. ``json_route``
gives such a route's ``app.post`` keyword arguments that document its body and responses, and
``publish_schemas`` makes the app's /openapi.json carry the request models those refer to. How
requests are parsed and errors answered does not change: this module only writes documentation.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict
from pydantic.json_schema import models_json_schema

SCHEMA_REF = "#/components/schemas/{model}"

# FastAPI's own validation-error shape, which this server never sends (it answers with a 400).
FASTAPI_422_SCHEMAS = ("HTTPValidationError", "ValidationError")


class ErrorDetail(BaseModel):
    """What went wrong; ``param`` names the request field at fault, when one is."""

    model_config = ConfigDict(extra="forbid")

    message: str
    type: str
    param: Optional[str]
    code: Optional[str]


class ErrorResponse(BaseModel):
    """The body of every error response, in OpenAI's format."""

    model_config = ConfigDict(extra="forbid")

    error: ErrorDetail


class TokenizeResponse(BaseModel):
    """The body of a 200 from POST /tokenize."""

    model_config = ConfigDict(extra="forbid")

    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    """The body of a 200 from POST /detokenize."""

    model_config = ConfigDict(extra="forbid")

    prompt: str


ERRORS = {
    400: "The request is invalid; `param` names the field at fault when one is.",
    401: "The server has an API key and the request did not carry it.",
    404: "The request names a model this server does not serve.",
    500: "The engine failed this request alone (`request_failed`); the server and other "
    "requests go on.",
    503: "The server is at capacity (`queue_full`, retry after `Retry-After` s) or its engine "
    "has stopped (`engine_dead`).",
}


def error_responses(*statuses: int) -> dict[int, dict[str, Any]]:
    """``responses=`` entries documenting OpenAI-style error bodies for ``statuses``."""
    return {status: {"model": ErrorResponse, "description": ERRORS[status]} for status in statuses}


def json_route(
    request_model: type[BaseModel],
    response_model: Optional[type[BaseModel]],
    *,
    streams: bool = False,
    errors: Iterable[int] = (400, 401, 404),
) -> dict[str, Any]:
    """``app.post`` keyword arguments for a route that parses ``request_model`` from its raw body
    and answers ``response_model`` (None: a line of text; with ``streams``, server-sent events
    when asked to)."""
    success: dict[str, Any] = {"model": response_model, "description": "The result."}
    if response_model is None:
        success = {
            "description": "What was done.",
            "content": {"text/plain": {"schema": {"type": "string"}}},
        }
    if streams:
        success["description"] = "The result, or with `stream: true` server-sent events."
        success["content"] = {"text/event-stream": {"schema": {"type": "string"}}}
    request_body = {
        "required": True,
        "content": {"application/json": {"schema": {"$ref": schema_ref(request_model)}}},
    }
    return {
        "openapi_extra": {"requestBody": request_body},
        "responses": {200: success, **error_responses(*errors)},
    }


def schema_ref(model: type[BaseModel]) -> str:
    """Where ``model``'s schema lies in the OpenAPI document."""
    return SCHEMA_REF.format(model=model.__name__)


def publish_schemas(app: FastAPI, request_models: Iterable[type[BaseModel]]) -> None:
    """Make ``app.openapi()`` carry ``request_models``' schemas (as validated, with the models
    they use) among its components, and document no FastAPI 422 responses."""
    inputs = [(model, "validation") for model in request_models]
    _, top = models_json_schema(inputs, ref_template=SCHEMA_REF)
    definitions = top.get("$defs", {})
    build = app.openapi  # FastAPI's generator; it caches the document until the routes change

    def openapi() -> dict[str, Any]:
        document = build()
        schemas = document.setdefault("components", {}).setdefault("schemas", {})
        schemas.update(definitions)
        _drop_422(document)
        return document

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented override


def _drop_422(document: dict[str, Any]) -> None:
    """Remove FastAPI's 422 responses and their schemas: invalid requests get a 400 here."""
    for operations in document.get("paths", {}).values():
        for operation in operations.values():
            operation.get("responses", {}).pop("422", None)
    schemas = document.get("components", {}).get("schemas", {})
    for name in FASTAPI_422_SCHEMAS:
        schemas.pop(name, None)
