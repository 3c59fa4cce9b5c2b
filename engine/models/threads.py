"""The compute-thread policy: how many threads torch's intra-op pool (OpenMP) and the fused
kernels' pool use, and how idle threads wait.

Why a policy: torch's OpenMP team ends every parallel region in a barrier. When another
process takes a core, the thread on it is descheduled for a whole time slice and every
barrier waits for it; with hundreds of small parallel regions per decode step the step
collapses (measured in issue 10: 0.84 tok/s with 2 threads beside a busy process against
30.8 with 1). One thread never waits for a descheduled partner: it loses at most the
share of the core it gets. The fused kernels' own pool polls for at most 300 us between jobs,
yielding the core to any runnable thread between polls, then sleeps; its caller never waits
for a worker that has not started (cext/csrc/fused_kernels.c). With that pool, 2 threads beat
1 at batch 1 (SmolLM2 Q4_1: ~87 vs ~53 tok/s) and a busy neighbour costs ~18% (busy/quiet
0.82, benchmarks/decode.py --busy, load ~1.3).

The measured default (benchmarks/decode.py --busy on a 2-core AMD EPYC shared with other
jobs, load average 10-16, SmolLM2 bf16, batch 1, fused path; figures in issue 10's report):
- 2 threads, libgomp's default wait (spin, then sleep): 0.6 tok/s against 6.7 with 1 thread,
  and 0.3 beside one more busy process: the collapse.
- 2 threads with ``OMP_WAIT_POLICY=PASSIVE``: 5.3-7.7 tok/s, the same as 1 thread (6.0-7.3)
  under that load, and busy/quiet 0.49-0.60 (1 thread: 0.45-0.51), over four interleaved
  rounds. No collapse. (A quiet machine was not available; the issue measured ~40 GB/s of
  read bandwidth on one thread and ~77 on two, which the matmuls of a decode step use.)
So: with passive waiting in effect, one thread per available CPU (up to
``MAX_DEFAULT_THREADS``, beyond which nothing was measured); without it, one thread, since
a spinning team collapses whenever anything else runs. libgomp reads OMP_WAIT_POLICY only
when it loads (``import torch``), so the package sets it before anything imports torch:
first thing in ``engine/__init__.py``::

    import os, sys
    if "torch" not in sys.modules:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

(An import of this module cannot do it: ``engine.models`` imports torch on the way here.)
"""
from __future__ import annotations

import os
from dataclasses import dataclass

MAX_DEFAULT_THREADS = 8


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


def apply_thread_policy(num_threads: int | None = None) -> ThreadPolicy:
    """Sets torch's intra-op threads and the fused kernels' pool to ``num_threads``
    (None: the measured default). Raises ValueError for a count < 1."""
    if num_threads is None:
        num_threads = default_num_threads()
    elif isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
        raise ValueError(f"num_threads: must be a positive int or None, got {num_threads!r}")
    import torch

    if torch.get_num_threads() != num_threads:
        torch.set_num_threads(num_threads)
    kernel_threads = num_threads
    try:
        from cext import cpu
    except ImportError:
        kernel_threads = 0
    else:
        cpu.set_num_threads(num_threads)
    return ThreadPolicy(num_threads, kernel_threads, os.environ.get("OMP_WAIT_POLICY"))
