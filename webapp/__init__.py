"""The OpenAI-compatible HTTP server: ``create_app(engine)`` and ``serve(engine)``.

Two front-ends speak one protocol: Flask on waitress in this process (webapp.app, webapp.wsgi)
and Starlette behind Ray Serve's proxy (webapp.ray_ingress, webapp.ray_serve). Both call the same
framework-free pieces: webapp.protocol (parsing), webapp.generation (auth, admission, submission,
bodies), webapp.sse (chunks), webapp.errors, webapp.metrics and webapp.shared (constants).

Importing this package loads no web framework: ``create_app``, ``make_server`` and ``serve`` load
Flask and waitress on first use, so the Ray path never imports them.
"""
from __future__ import annotations

from .shared import DEFAULT_MAX_BODY_BYTES, DEFAULT_THREADS, RESERVED_THREADS, STATIC_DIR

_LAZY = {"create_app": "app", "make_server": "wsgi", "serve": "wsgi"}


def __getattr__(name: str):
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'webapp' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"{__name__}.{module_name}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = ["create_app", "serve", "make_server", "DEFAULT_MAX_BODY_BYTES", "DEFAULT_THREADS",
           "RESERVED_THREADS", "STATIC_DIR"]
