"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` with a 4xx/5xx status."""
from __future__ import annotations

import json

from engine.errors import (
    ContextLengthError,
    EngineDead,
    EngineError,
    EngineOverloaded,
    InvalidParameterError,
)


class APIError(Exception):
    """An error the client caused or must react to; rendered as an OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def __reduce__(self):  # picklable with all its fields (it crosses process boundaries under Ray Serve)
        return (APIError, (self.status, self.message, self.type, self.param, self.code, self.headers))

    def to_dict(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def body(self) -> bytes:
        return json.dumps(self.to_dict()).encode()


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def context_length_exceeded(message: str, param: str | None) -> APIError:
    return APIError(400, message, param=param, code="context_length_exceeded")


def overloaded(reason: str = "waiting queue full", retry_after_s: int = 1) -> APIError:
    return APIError(
        429,
        f"The server is at capacity ({reason}); retry shortly.",
        type="rate_limit_error",
        code="rate_limit_exceeded",
        headers={"Retry-After": str(retry_after_s)},
    )


def engine_dead() -> APIError:
    return APIError(503, "The engine has stopped; this server can no longer generate.", type="server_error",
                    code="engine_dead")


def unauthorized() -> APIError:
    return APIError(401, "Missing or invalid API key: send 'Authorization: Bearer <key>'.",
                    code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def internal_error() -> APIError:
    return APIError(500, "Internal server error.", type="server_error", code="internal_error")


# Werkzeug/Flask HTTP errors mapped to OpenAI error types.
HTTP_ERROR_CODES = {
    404: ("invalid_request_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    413: ("invalid_request_error", "request_too_large"),
    415: ("invalid_request_error", "unsupported_media_type"),
}


def from_http_status(status: int, message: str) -> APIError:
    type_, code = HTTP_ERROR_CODES.get(status, ("server_error" if status >= 500 else "invalid_request_error", None))
    return APIError(status, message, type=type_, code=code)


# The one mapping from engine exceptions to HTTP errors, most specific type first.
_EXCEPTION_ERRORS = (
    (APIError, lambda e: e),
    (EngineOverloaded, lambda e: overloaded()),
    (EngineDead, lambda e: engine_dead()),
    (EngineError, lambda e: APIError(500, str(e), type="server_error", code="engine_error")),
    (ContextLengthError, lambda e: context_length_exceeded(str(e), e.param)),
    (InvalidParameterError, lambda e: bad_request(str(e), e.param)),
    (ValueError, lambda e: bad_request(str(e))),
)


def from_exception(exc: BaseException) -> APIError:
    """The APIError for an exception raised by the engine (internal_error for anything unexpected)."""
    for exc_type, make in _EXCEPTION_ERRORS:
        if isinstance(exc, exc_type):
            return make(exc)
    return internal_error()
