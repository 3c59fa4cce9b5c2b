"""The process heap's free pages, handed back to the OS, and the number of heaps glibc keeps.

glibc keeps the pages of freed blocks for reuse: after a model loads (its repacking
temporaries), after a prompt chunk (its activations) and before a tick's logits are mapped
afresh, those pages would otherwise stay resident beside what replaces them.

glibc also gives each new thread that allocates a heap of its own (an arena; up to 8 per core),
and a block freed in one arena serves only that arena's threads. The engine's threads (the
engine thread, its output worker, the kernels' pool, the sampler's, the server's request
threads) then each keep their own free pages: Gemma 3 270M's peak resident size over 16
streams was ~15-30 MB higher with glibc's default than with two arenas, at the same speed
(docs/performance.md, "Two malloc arenas").
"""

from __future__ import annotations

import ctypes
import os

_trim = None  # libc's malloc_trim, found on first use (False: not glibc)
_M_ARENA_MAX = -8  # glibc's mallopt parameter
ENGINE_ARENAS = 2  # the main thread's arena and one the other threads share
_arenas_limited = False


def limit_arenas() -> bool:
    """At most ENGINE_ARENAS malloc arenas for threads that allocate from now on (mallopt
    M_ARENA_MAX), unless the environment sets MALLOC_ARENA_MAX (glibc's own knob, read at
    start-up: it stays the user's choice). Called before an engine starts its threads; once per
    process. True if the limit was set now."""
    global _arenas_limited
    if _arenas_limited or "MALLOC_ARENA_MAX" in os.environ:
        return False
    _arenas_limited = True
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False  # not glibc
    return bool(mallopt(_M_ARENA_MAX, ENGINE_ARENAS))


def release_free_heap() -> bool:
    """malloc_trim(0): every arena's free pages back to the OS (~50 MB of Qwen2.5-0.5B's resident
    size after load). True if glibc released any; False where there is nothing to call (no glibc)."""
    global _trim
    if _trim is None:
        try:
            _trim = ctypes.CDLL(None).malloc_trim
        except (OSError, AttributeError):
            _trim = False
    return bool(_trim and _trim(0))
