"""Exceptions the engine raises to callers. The type carries the meaning (what went wrong,
which parameter): callers branch on types and read ``param``, never the message text.

    ValueError
    └── InvalidParameterError        a request field is wrong; .param names it
        ├── ContextLengthError       prompt + max_tokens do not fit the context
        ├── SchedulerRefused         the scheduler cannot hold a sequence (rows, KV cache, ids)
        └── (ChatTemplateError)      messages the chat template cannot render (tokenizer)
    └── ModelFileError               a model path is missing, incomplete, truncated or corrupt; .path
    RuntimeError
    └── EngineError                  a request failed inside the engine
        ├── EngineDead               the engine thread is gone; nothing can run
        └── EngineOverloaded         the waiting queue is full; retry later
"""
from __future__ import annotations


class InvalidParameterError(ValueError):
    """A request parameter is invalid. ``param`` is the field's name as the caller spelt it
    (``"max_tokens"``, ``"messages[1].content"``), or None when no single field is to blame."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class ContextLengthError(InvalidParameterError):
    """The prompt (plus the tokens asked for) does not fit the model's context.

    ``param`` is the field that is too long ("prompt", "messages") or "max_tokens"
    when the prompt fits but the requested completion does not."""

    def __init__(self, message: str, param: str | None = "prompt", *, max_model_len: int | None = None):
        super().__init__(message, param)
        self.max_model_len = max_model_len


class SchedulerRefused(InvalidParameterError):
    """The scheduler (engine/core/scheduler.py) cannot take a sequence: more tokens than its rows
    hold, more KV blocks than its cache has, or an id already scheduled. The request layer has
    checked the request against the model's limits before (ContextLengthError); this is the
    scheduler's own guard of its buffers. ``param`` names what to change ("max_tokens",
    "request_id"), or None."""


class ModelFileError(ValueError):
    """A model path cannot be loaded: missing, not a model, an HF directory without its
    tokenizer or weights, a truncated or corrupt GGUF. ``path`` is the offending path; the
    message starts with it. Raised before any weights load."""

    def __init__(self, message: str, path: str):
        super().__init__(message)
        self.path = path


class EngineError(RuntimeError):
    """A request failed inside the engine; the message says why."""


class EngineDead(EngineError):
    """The engine thread is gone (closed or crashed); no request can run."""


class EngineOverloaded(EngineError):
    """The waiting queue is full; retry later."""


__all__ = [
    "ContextLengthError", "EngineDead", "EngineError", "EngineOverloaded", "InvalidParameterError",
    "ModelFileError", "SchedulerRefused",
]
