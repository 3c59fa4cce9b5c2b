"""What both front-ends share, with no web framework: the limits' defaults, the generation
routes' names, the page's static directory and the server's version.

The Flask server (webapp.app, webapp.wsgi) and the Ray Serve ingress (webapp.ray_ingress)
import this module; importing it loads neither Flask nor Starlette.
"""
from __future__ import annotations

import importlib.metadata
import os

DEFAULT_MAX_BODY_BYTES = 4 << 20
DEFAULT_THREADS = 64
# Handler threads kept free of generation requests, so /health, /metrics, /v1/models and the
# 429 answers themselves always find a thread (benchmarks/overload.py measures the probe latency).
RESERVED_THREADS = 8
# The routes whose every answer, refusals included, counts in llm:request_success_total.
GENERATION_ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions",
                        "/v1/responses": "responses", "/infill": "infill"}
STATIC_DIR = os.path.join(os.path.dirname(__file__), "static")


def version() -> str:
    """The installed distribution's version (GET /version), or the engine package's own."""
    import engine as engine_package

    try:
        return importlib.metadata.version("llm-engine")
    except importlib.metadata.PackageNotFoundError:
        return getattr(engine_package, "__version__", "0+unknown")
