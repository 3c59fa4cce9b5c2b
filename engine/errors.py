"""Exceptions the engine raises to callers."""


class EngineError(RuntimeError):
    """A request failed inside the engine; the message says why."""


class EngineDead(EngineError):
    """The engine thread is gone (closed or crashed); no request can run."""


class EngineOverloaded(EngineError):
    """The waiting queue is full; retry later."""
