"""ASGI middleware: X-Request-Id on every response, and the API key check."""

from __future__ import annotations

import hmac
import re
import uuid
from typing import Optional

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from octavo.entrypoints.openai.errors import OpenAIError

PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


class RequestIdMiddleware:
    """Echo the client's ``X-Request-Id`` (or a fresh one) in the response headers."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = _header(scope, b"x-request-id")
        request_id = given if given is not None and _REQUEST_ID.match(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (b"x-request-id", request_id.encode())]
            await send(message)

        await self.app(scope, receive, send_with_id)


class ApiKeyMiddleware:
    """401 for API routes unless ``Authorization: Bearer <key>`` carries the key."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.api_key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(PROTECTED_PREFIXES):
            header = _header(scope, b"authorization") or ""
            scheme, _, token = header.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                token.strip().encode(), self.api_key
            ):
                error = OpenAIError(
                    "missing or invalid API key; send 'Authorization: Bearer <key>'",
                    401,
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _header(scope: Scope, name: bytes) -> Optional[str]:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None
