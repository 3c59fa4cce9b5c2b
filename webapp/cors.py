"""CORS for browser clients on other origins: off unless ``--allowed-origins`` names some.

A request whose ``Origin`` is allowed gets ``Access-Control-Allow-Origin`` (that origin, or
``*`` when any is allowed); a preflight (OPTIONS with ``Access-Control-Request-Method``)
from it is answered 204 before routing and before the API-key check (browsers send no
credentials on a preflight). Other origins get no CORS headers: the browser blocks them.
"""
from __future__ import annotations

from flask import Flask, Response, request

ALLOWED_METHODS = "GET, POST, OPTIONS"
ALLOWED_HEADERS = "Authorization, Content-Type"
MAX_AGE_SECONDS = "600"


def parse_origins(value: str | None) -> list[str]:
    """``--allowed-origins`` text: comma-separated origins ("https://a.example,http://localhost:3000") or "*"."""
    if not value:
        return []
    return [origin.strip().rstrip("/") for origin in value.split(",") if origin.strip()]


def install(app: Flask, allowed_origins: list[str]) -> None:
    allow_any = "*" in allowed_origins
    allowed = frozenset(allowed_origins)

    def allowed_origin() -> str | None:
        origin = request.headers.get("Origin")
        if origin is None:
            return None
        if allow_any:
            return "*"
        return origin if origin in allowed else None

    @app.before_request
    def _preflight():
        if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
            origin = allowed_origin()
            response = Response(status=204)
            if origin is not None:
                response.headers["Access-Control-Allow-Methods"] = ALLOWED_METHODS
                response.headers["Access-Control-Allow-Headers"] = ALLOWED_HEADERS
                response.headers["Access-Control-Max-Age"] = MAX_AGE_SECONDS
            return response

    @app.after_request
    def _allow_origin(response: Response) -> Response:
        origin = allowed_origin()
        if origin is not None:
            response.headers["Access-Control-Allow-Origin"] = origin
            if origin != "*":
                response.headers["Vary"] = "Origin"
        return response
