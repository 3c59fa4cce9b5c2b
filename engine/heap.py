"""The process heap's free pages, handed back to the OS.

glibc keeps the pages of freed blocks for reuse: after a model loads (its repacking
temporaries), after a prompt chunk (its activations) and before a tick's logits are mapped
afresh, those pages would otherwise stay resident beside what replaces them.
"""

from __future__ import annotations

import ctypes

_trim = None  # libc's malloc_trim, found on first use (False: not glibc)


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
