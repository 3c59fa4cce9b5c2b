"""An embeddable LLM inference engine: continuous batching, paged KV, O(1) per-token host path.

The public surface is at this level (api, chat, request_stream, async_stream, outputs, params,
errors, config); the engine thread in core/, ids -> text in text/, token choice in sampling/,
the decoder in models/ (the layers and a request's path: docs/architecture.md). Public names
load lazily, so `import engine.params` stays light.
"""
from __future__ import annotations

import importlib
import os
import sys

# torch's OpenMP team waits passively (sleeps) instead of spinning: a spinning team collapses
# when another process shares the cores (docs/performance.md has the measurements).
# libgomp reads this once, when torch is first imported, so it is set before anything loads torch.
if "torch" not in sys.modules:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.2.0"

_EXPORTS = {
    "Engine": "api",
    "RequestStream": "api",
    "AsyncRequestStream": "async_stream",
    "EngineDead": "errors",
    "EngineError": "errors",
    "EngineOverloaded": "errors",
    "InvalidParameterError": "errors",
    "ContextLengthError": "errors",
    "ModelFileError": "errors",
    "EngineConfig": "config",
    "Completion": "outputs",
    "StreamEvent": "outputs",
    "TokenLogprob": "outputs",
    "Usage": "outputs",
    "SamplingParams": "params",
    "ToolCall": "outputs",
    "ToolCallDelta": "outputs",
    "Tokenizer": "tokenizer",
    "load_tokenizer": "tokenizer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + __all__)
