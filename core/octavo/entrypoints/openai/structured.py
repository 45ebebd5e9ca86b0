"""A request body's output constraint, as OpenAI and vLLM spell it: ``response_format``
(``json_object``, ``json_schema``, ``structural_tag``), vLLM's ``structured_outputs`` extra
field, and the ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``
names vLLM had before it (accepted as aliases: a client still sending them must not get free
text with a 200). The grammar is compiled off the event loop, within a time limit, before the
request is admitted: a constraint that cannot be compiled is a 400 naming its field."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Optional

from octavo.entrypoints.openai.errors import bad_request
from octavo.sampling_params import SamplingParams
from octavo.structured_output import StructuredOutputsParams

COMPILE_TIMEOUT_S = 30.0
RESPONSE_FORMATS = ("text", "json_object", "json_schema", "structural_tag")
_GUIDED = (
    ("guided_json", "json"),
    ("guided_regex", "regex"),
    ("guided_choice", "choice"),
    ("guided_grammar", "grammar"),
)


def _from_response_format(response_format: dict[str, Any]) -> Optional[dict[str, Any]]:
    kind = response_format.get("type", "text")
    if kind not in RESPONSE_FORMATS:
        raise bad_request(
            f"response_format.type must be one of {', '.join(RESPONSE_FORMATS)}; got {kind!r}",
            param="response_format",
        )
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "structural_tag":
        return {"structural_tag": response_format}
    json_schema = response_format.get("json_schema")
    schema = json_schema.get("schema") if isinstance(json_schema, dict) else None
    if not isinstance(schema, dict):
        raise bad_request(
            "response_format.json_schema.schema must be a JSON schema object "
            '(response_format: {"type": "json_schema", "json_schema": {"name": ..., '
            '"schema": {...}}})',
            param="response_format",
        )
    return {"json": schema}


def constraint_of(body: Any) -> tuple[Optional[StructuredOutputsParams], Optional[str]]:
    """``(constraint, the body field it came from)``, or ``(None, None)`` for free text; a 400
    naming the field when it is malformed or when two fields both ask for one."""
    given: list[tuple[str, dict[str, Any]]] = []
    if body.structured_outputs is not None:
        fields = dict(body.structured_outputs)
        if "disable_any_whitespace" in fields:  # vLLM's name for it
            fields["any_whitespace"] = not fields.pop("disable_any_whitespace")
        given.append(("structured_outputs", fields))
    if body.response_format is not None:
        fields = _from_response_format(body.response_format)
        if fields is not None:
            given.append(("response_format", fields))
    for old, new in _GUIDED:
        value = getattr(body, old)
        if value is not None:
            given.append((old, {new: value}))
    if not given:
        return None, None
    if len(given) > 1:
        names = ", ".join(name for name, _ in given)
        raise bad_request(f"give one output constraint; got {names}", param=given[1][0])
    field, fields = given[0]
    try:
        return StructuredOutputsParams(**fields), field
    except TypeError as exc:  # an unknown key of structured_outputs
        raise bad_request(f"{field}: {exc}", param=field) from None
    except ValueError as exc:
        raise bad_request(f"{field}: {exc}", param=field) from None


async def constrain(
    engine: Any,
    params: SamplingParams,
    constraint: Optional[StructuredOutputsParams],
    field: Optional[str],
) -> SamplingParams:
    """``params`` with ``constraint`` (from the body's ``field``), its grammar compiled (or
    found in the cache) on a worker thread within ``COMPILE_TIMEOUT_S``; a 400 naming the field
    when it cannot be."""
    if constraint is None:
        return params
    backend = engine.grammar_backend
    try:
        await asyncio.wait_for(
            asyncio.to_thread(lambda: backend().compile(constraint)), COMPILE_TIMEOUT_S
        )
    except asyncio.TimeoutError:
        raise bad_request(
            f"{field}: its grammar did not compile within {COMPILE_TIMEOUT_S:.0f} s; "
            "simplify the schema",
            param=field,
        ) from None
    except ValueError as exc:
        raise bad_request(f"{field}: {exc}", param=field) from None
    return dataclasses.replace(params, structured_outputs=constraint)
