"""Engine factories for Ray Serve replicas in tests (webapp.ray_serve.EngineSpec names them by import path:
a replica builds its own engine, so the factory and its arguments must be importable and picklable)."""
from __future__ import annotations

import socket
import time

from tests.server_fixtures import SCRIPT_TEXT, scripted_engine

# Ports a local Ray binds by default without asking the OS (the dashboard agent's HTTP port is 52365, in the
# ephemeral range: an OS-picked free port collided with it in CI, and Serve then failed to bind).
RAY_DEFAULT_PORTS = frozenset({6379, 8000, 8076, 8265, 10001, 52365})


def serve_port() -> int:
    """A free local port for Serve's proxy. Call it after ``ray.init``: Ray's own ports are taken by then,
    and its default ones are never returned even if an agent has not bound yet."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in RAY_DEFAULT_PORTS:
            return port


class PacedModel:
    """A ScriptedModel engine's model, slowed to ``seconds_per_tick`` per forward: a stream lasts long
    enough for a test to kill its replica mid-way."""

    def __init__(self, inner, seconds_per_tick: float):
        self.inner = inner
        self.vocab_size = inner.vocab_size
        self.max_model_len = None
        self.seconds_per_tick = seconds_per_tick

    def make_kv_cache(self, num_blocks: int, block_size: int):
        return self.inner.make_kv_cache(num_blocks, block_size)

    def forward(self, batch, kv_cache):
        time.sleep(self.seconds_per_tick)
        return self.inner.forward(batch, kv_cache)


def scripted_replica_engine(text: str = SCRIPT_TEXT, seconds_per_tick: float = 0.0, **options):
    """tests.server_fixtures.scripted_engine (the ScriptedModel over the default tokenizer), optionally paced."""
    eng = scripted_engine(text, **options)
    if seconds_per_tick <= 0:
        return eng
    import engine

    model = PacedModel(eng.model, seconds_per_tick)
    tokenizer, config = eng.tokenizer, eng.config
    eng.close()
    return engine.Engine(model, tokenizer, max_model_len=config.max_model_len, max_num_seqs=config.max_num_seqs)


def failing_engine(**options):
    raise FileNotFoundError("model file /nonexistent/model.gguf does not exist")
