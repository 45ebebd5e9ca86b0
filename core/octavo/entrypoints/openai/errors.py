"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status."""

from __future__ import annotations

from typing import Any, Optional

from fastapi.responses import JSONResponse

# HTTP status -> OpenAI's error type for it.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    500: "internal_error",
    503: "service_unavailable_error",
}


class OpenAIError(Exception):
    """An error the API reports to the client in OpenAI's format."""

    def __init__(
        self,
        message: str,
        status_code: int = 400,
        *,
        param: Optional[str] = None,
        code: Optional[str] = None,
        headers: Optional[dict[str, str]] = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        """The JSON body OpenAI clients parse."""
        return {
            "error": {
                "message": self.message,
                "type": ERROR_TYPES.get(self.status_code, "invalid_request_error"),
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        """This error as an HTTP response."""
        return JSONResponse(self.body(), status_code=self.status_code, headers=self.headers)


def bad_request(
    message: str, param: Optional[str] = None, code: Optional[str] = None
) -> OpenAIError:
    """A 400 about the request body."""
    return OpenAIError(message, 400, param=param, code=code)


def from_value_error(exc: ValueError, known_params: Any = ()) -> OpenAIError:
    """A 400 from a ValueError whose message starts with the offending field's name."""
    message = str(exc)
    first_word = message.split(" ", 1)[0]
    return bad_request(message, param=first_word if first_word in known_params else None)


def from_validation_errors(errors: list[dict[str, Any]]) -> OpenAIError:
    """A 400 from pydantic's errors, naming the first field at fault."""
    if not errors:
        return bad_request("the request body is not valid")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return bad_request(
            "the request body is not valid JSON: "
            f"{first.get('ctx', {}).get('error', first['msg'])}",
            code="invalid_json",
        )
    location = tuple(first.get("loc", ()))
    if not location:
        return bad_request(f"the request body must be a JSON object: {first['msg']}")
    field = location[0]
    # A union reports one error per alternative, each located at (field, alternative, ...).
    alternatives = [
        e["loc"][1]
        for e in errors
        if len(e.get("loc", ())) == 2 and e["loc"][0] == field and isinstance(e["loc"][1], str)
    ]
    if len(alternatives) > 1 and len(alternatives) == sum(
        1 for e in errors if e.get("loc", (None,))[0] == field
    ):
        got = first.get("input")
        message = f"{field}: {got!r} ({type(got).__name__}) is none of: {', '.join(alternatives)}"
    else:
        message = f"{'.'.join(str(part) for part in location)}: {first['msg']}"
    num_other_fields = len({e.get("loc", (None,))[0] for e in errors} - {field})
    if num_other_fields:
        message += (
            f" (and errors in {num_other_fields} more field{'s' if num_other_fields > 1 else ''})"
        )
    return bad_request(message, param=str(field))
