"""engine.heap.limit_arenas: the engine's threads share two malloc arenas instead of one each,
unless the environment chose (MALLOC_ARENA_MAX). Each case runs in a fresh interpreter: the limit
is process-wide and applies to threads that first allocate after it."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from engine import heap

# Threads that each hold malloc'd blocks at once, then glibc's malloc_info counts the heaps.
_PROBE = r"""
import ctypes, os, shutil, sys, tempfile, threading
from engine import heap
if sys.argv[1] == "limit":
    print("limited", heap.limit_arenas())
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.fopen.restype = ctypes.c_void_p
libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
libc.fclose.argtypes = [ctypes.c_void_p]
held, barrier = [], threading.Barrier(9)
def work():
    held.extend(libc.malloc(65536) for _ in range(4))
    barrier.wait()
    barrier.wait()
threads = [threading.Thread(target=work) for _ in range(8)]
for t in threads: t.start()
barrier.wait()
folder = tempfile.mkdtemp()
path = os.path.join(folder, "info.xml")
stream = libc.fopen(path.encode(), b"w")
libc.malloc_info(0, stream)
libc.fclose(stream)
barrier.wait()
for t in threads: t.join()
print("arenas", open(path).read().count("<heap nr="))
shutil.rmtree(folder)
"""


def _probe(mode: str, env: dict[str, str] | None = None) -> dict[str, str]:
    run_env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    run_env.update(env or {})
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, env=run_env,
                         check=True).stdout
    return dict(line.split(" ", 1) for line in out.splitlines())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's arenas")
def test_threads_share_two_arenas_after_the_limit():
    unlimited = _probe("none")
    assert int(unlimited["arenas"]) > heap.ENGINE_ARENAS  # glibc's default: a heap per thread (up to 8 a core)
    limited = _probe("limit")
    assert limited["limited"] == "True"
    assert int(limited["arenas"]) <= heap.ENGINE_ARENAS


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's arenas")
def test_the_environment_keeps_its_choice():
    """MALLOC_ARENA_MAX set: glibc has read it, and limit_arenas leaves it be."""
    chosen = _probe("limit", {"MALLOC_ARENA_MAX": "4"})
    assert chosen["limited"] == "False"
    assert 2 < int(chosen["arenas"]) <= 4


def test_an_engine_limits_them_before_its_threads_start(monkeypatch):
    """Engine() sets the limit once, before EngineCore starts its threads."""
    from server_fixtures import scripted_engine

    calls = []
    monkeypatch.setattr(heap, "limit_arenas", lambda: calls.append("limit"))
    monkeypatch.setattr("engine.api.EngineCore.__init__", _recording_init(calls))
    eng = scripted_engine()
    try:
        assert calls[:2] == ["limit", "core"]
    finally:
        eng.close()


def _recording_init(calls):
    from engine.core.runtime import EngineCore

    original = EngineCore.__init__

    def init(self, *args, **kwargs):
        calls.append("core")
        original(self, *args, **kwargs)
    return init


def test_limit_arenas_runs_once(monkeypatch):
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    monkeypatch.setattr(heap, "_arenas_limited", False)
    heap.limit_arenas()
    assert heap._arenas_limited
    assert heap.limit_arenas() is False
