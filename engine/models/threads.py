"""The compute-thread policy: how many threads torch's intra-op pool (OpenMP) and the fused
kernels' pool use, and how idle threads wait.

torch's OpenMP team ends every parallel region in a barrier, so a spinning team collapses
when another process takes one of its cores; a passive (sleeping) team does not. So: with
``OMP_WAIT_POLICY=PASSIVE`` in effect, one torch thread per available CPU (up to
``MAX_DEFAULT_THREADS``, beyond which nothing was measured); without it, one torch thread. The
kernels' own pool polls briefly between jobs, then sleeps (cext/csrc/cpu.c), whatever libgomp
does, so it takes one thread per available CPU either way: a decode step runs on it (the
quantized products and the ops between them), torch's team only the BLAS of long prompts.
The measurements behind this, and the commands that repeat them: docs/performance.md.

libgomp reads OMP_WAIT_POLICY only when it loads (``import torch``), so the package sets it
before anything imports torch: first thing in ``engine/__init__.py``::

    import os, sys
    if "torch" not in sys.modules:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

(An import of this module cannot do it: ``engine.models`` imports torch on the way here.)
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

MAX_DEFAULT_THREADS = 8
log = logging.getLogger(__name__)
_warned_one_thread = False


@dataclass(frozen=True, slots=True)
class ThreadPolicy:
    num_threads: int  # torch intra-op threads
    num_kernel_threads: int  # the fused kernels' pool, caller included
    omp_wait_policy: str | None  # as libgomp read it at load (None: its default, spin then sleep)


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask, not the machine's count)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def is_wait_passive() -> bool:
    """Whether idle OpenMP threads sleep: OMP_WAIT_POLICY=PASSIVE in the environment (which
    libgomp read if it was there before torch was imported)."""
    return os.environ.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE"


def default_num_threads() -> int:
    if not is_wait_passive():
        return 1
    return max(1, min(available_cpus(), MAX_DEFAULT_THREADS))


def default_kernel_threads() -> int:
    """The kernels' pool: one thread per available CPU (up to MAX_DEFAULT_THREADS), whatever
    torch's wait policy (the pool does not spin at barriers)."""
    return max(1, min(available_cpus(), MAX_DEFAULT_THREADS))


def apply_thread_policy(num_threads: int | None = None) -> ThreadPolicy:
    """Sets torch's intra-op threads and the fused kernels' pool to ``num_threads`` (None: the
    measured defaults, default_num_threads and default_kernel_threads). Raises ValueError for a
    count < 1."""
    if num_threads is None:
        num_threads, kernel_threads = default_num_threads(), default_kernel_threads()
        _warn_if_one_thread_by_import_order(num_threads)
    elif isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
        raise ValueError(f"num_threads: must be a positive int or None, got {num_threads!r}")
    else:
        kernel_threads = num_threads
    import torch

    if torch.get_num_threads() != num_threads:
        torch.set_num_threads(num_threads)
    try:
        from cext import cpu
    except ImportError:
        kernel_threads = 0
    else:
        cpu.set_num_threads(kernel_threads)
    return ThreadPolicy(num_threads, kernel_threads, os.environ.get("OMP_WAIT_POLICY"))


def _warn_if_one_thread_by_import_order(num_threads: int) -> None:
    """Once per process: torch's default fell to one thread only because torch was loaded before
    engine without OMP_WAIT_POLICY (a notebook's `import torch` first): prompts' BLAS products
    at half the speed on two cores, silently, unless said."""
    global _warned_one_thread
    if num_threads == 1 and available_cpus() > 1 and "OMP_WAIT_POLICY" not in os.environ \
            and not _warned_one_thread:
        _warned_one_thread = True
        log.warning("torch threads: 1 of %d CPUs (the kernels' pool keeps %d), because torch was imported "
                    "before engine with OMP_WAIT_POLICY unset (libgomp's spinning wait collapses on shared "
                    "cores): long prompts' products run on one thread; import engine first, set "
                    "OMP_WAIT_POLICY=PASSIVE before torch loads, or pass num_threads",
                    available_cpus(), default_kernel_threads())
