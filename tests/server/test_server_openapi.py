"""/openapi.json publishes the request and response bodies of the routes that parse their own
bodies, OpenAI's error shape for their errors and no FastAPI 422; /docs is served."""

from __future__ import annotations

from typing import Any, Iterator

import httpx2 as httpx
import pytest
from server_constants import MODEL_NAME

SCHEMAS = "#/components/schemas/"

# route -> (request model, fields its schema must list, required fields, 200 response model)
GENERATION_ROUTES = {
    "/v1/completions": (
        "CompletionRequest",
        {
            "prompt",
            "max_tokens",
            "temperature",
            "top_p",
            "top_k",
            "seed",
            "n",
            "logprobs",
            "stream",
        },
        {"prompt"},
        "CompletionResponse",
    ),
    "/v1/chat/completions": (
        "ChatCompletionRequest",
        {
            "messages",
            "max_completion_tokens",
            "max_tokens",
            "temperature",
            "top_k",
            "seed",
            "n",
            "logprobs",
            "top_logprobs",
            "stream",
        },
        {"messages"},
        "ChatCompletionResponse",
    ),
}
TOKENIZER_ROUTES = {
    "/tokenize": ("TokenizeRequest", {"prompt", "messages"}, set(), "TokenizeResponse"),
    "/detokenize": ("DetokenizeRequest", {"tokens"}, {"tokens"}, "DetokenizeResponse"),
}
ROUTES = {**GENERATION_ROUTES, **TOKENIZER_ROUTES}


@pytest.fixture(scope="module")
def document(server) -> dict[str, Any]:
    """The server's OpenAPI document, fetched over HTTP."""
    response = httpx.get(f"{server.base_url}/openapi.json")
    assert response.status_code == 200, response.text
    return response.json()


def resolve(document: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    """``schema``, or the component its ``$ref`` points at."""
    ref = schema.get("$ref")
    if ref is None:
        return schema
    assert ref.startswith(SCHEMAS), ref
    return document["components"]["schemas"][ref.removeprefix(SCHEMAS)]


def ref_name(schema: dict[str, Any]) -> str:
    """The component name a ``{"$ref": ...}`` schema points at."""
    assert set(schema) == {"$ref"}, schema
    return schema["$ref"].removeprefix(SCHEMAS)


def operation(document: dict[str, Any], route: str) -> dict[str, Any]:
    """The POST operation of ``route``."""
    return document["paths"][route]["post"]


def all_refs(node: Any) -> Iterator[str]:
    """Every ``$ref`` anywhere in ``node``."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref":
                yield value
            else:
                yield from all_refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from all_refs(value)


@pytest.mark.parametrize("route", ROUTES)
def test_route_publishes_its_json_request_body(document, route):
    model, fields, required, _ = ROUTES[route]
    body = operation(document, route)["requestBody"]
    assert body["required"] is True
    assert list(body["content"]) == ["application/json"]
    schema = body["content"]["application/json"]["schema"]
    assert ref_name(schema) == model
    resolved = resolve(document, schema)
    assert resolved["type"] == "object"
    assert fields <= set(resolved["properties"]), fields - set(resolved["properties"])
    assert set(resolved.get("required", ())) == required


def test_request_schemas_describe_field_types(document):
    completion = resolve(document, {"$ref": f"{SCHEMAS}CompletionRequest"})["properties"]
    assert "integer" in json_types(document, completion["top_k"])
    assert "integer" in json_types(document, completion["seed"])
    assert "number" in json_types(document, completion["temperature"])
    assert {"string", "array"} <= json_types(document, completion["prompt"])
    chat = resolve(document, {"$ref": f"{SCHEMAS}ChatCompletionRequest"})["properties"]
    message = resolve(document, chat["messages"]["items"])
    assert {"role", "content"} <= set(message["properties"])
    assert json_types(document, chat["logprobs"]) == {"boolean"}


def json_types(document: dict[str, Any], schema: dict[str, Any]) -> set[str]:
    """The JSON types a property's schema allows (through ``anyOf`` and ``$ref``)."""
    schema = resolve(document, schema)
    if "anyOf" in schema:
        return set().union(*(json_types(document, option) for option in schema["anyOf"]))
    return {schema["type"]}


@pytest.mark.parametrize("route", ROUTES)
def test_route_publishes_its_200_response(document, route):
    _, _, _, model = ROUTES[route]
    success = operation(document, route)["responses"]["200"]
    assert ref_name(success["content"]["application/json"]["schema"]) == model
    assert "properties" in resolve(document, success["content"]["application/json"]["schema"])
    if route in GENERATION_ROUTES:
        assert "text/event-stream" in success["content"]


@pytest.mark.parametrize("route", ROUTES)
def test_route_publishes_openai_error_bodies(document, route):
    responses = operation(document, route)["responses"]
    statuses = {"400", "404", "503"} if route in GENERATION_ROUTES else {"400", "404"}
    assert statuses <= set(responses)
    for status in statuses:
        error_body = resolve(document, responses[status]["content"]["application/json"]["schema"])
        error = resolve(document, error_body["properties"]["error"])
        assert set(error["properties"]) == {"message", "type", "param", "code"}
        assert set(error["required"]) == {"message", "type", "param", "code"}


def test_no_fastapi_422_is_published(document):
    for path, operations in document["paths"].items():
        for method, details in operations.items():
            assert "422" not in details["responses"], (method, path)
    assert "HTTPValidationError" not in document["components"]["schemas"]


def test_every_ref_resolves(document):
    refs = set(all_refs(document))
    assert refs, "the document should use component refs"
    components = document["components"]["schemas"]
    assert not {ref for ref in refs if ref.removeprefix(SCHEMAS) not in components}


def test_published_responses_match_real_ones(server, document):
    """The documented 200 and error bodies have the fields real responses have."""
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        completion = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        tokenized = http.post("/tokenize", json={"prompt": "hi"})
        error = http.post("/v1/completions", json={"prompt": "hi", "model": f"not-{MODEL_NAME}"})
    assert_matches(document, "CompletionResponse", completion, 200)
    assert_matches(document, "TokenizeResponse", tokenized, 200)
    assert_matches(document, "ErrorResponse", error, 404)
    assert_matches(document, "ErrorDetail", error, 404, key="error")


def assert_matches(document, model: str, response, status: int, key: str = "") -> None:
    """``response`` has ``status`` and a body (or its ``key``) with exactly the fields the
    published ``model`` lists, the required ones included."""
    assert response.status_code == status, response.text
    body = response.json()[key] if key else response.json()
    schema = resolve(document, {"$ref": f"{SCHEMAS}{model}"})
    assert set(body) <= set(schema["properties"]), set(body) - set(schema["properties"])
    assert set(schema.get("required", ())) <= set(body)


def test_docs_page_is_served(server):
    response = httpx.get(f"{server.base_url}/docs")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    assert "/openapi.json" in response.text
