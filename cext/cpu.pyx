"""The CPU the kernels run on (cext/csrc/cpu.h): one feature probe (CPUID, XCR0 and, for AMX,
Linux's tile-data permission), one instruction-set switch and one thread pool, shared by every
kernel module (cext.ops, cext.qgemm, cext.sampler bind to them through ``_api`` at import).
"""
from cpython.pycapsule cimport PyCapsule_New
from libc.stdint cimport int64_t, intptr_t, uint64_t

ISA_NAMES = {CPU_ISA_BASELINE: "baseline", CPU_ISA_AVX2: "avx2", CPU_ISA_AVX512: "avx512"}
_ISA_CODES = {name: code for code, name in ISA_NAMES.items()}
FEATURE_NAMES = {CPU_HAS_AVX2: "avx2", CPU_HAS_AVX512: "avx512", CPU_HAS_AVX512_VNNI: "avx512_vnni",
                 CPU_HAS_AVX512_BF16: "avx512_bf16", CPU_HAS_AVX512_FP16: "avx512_fp16",
                 CPU_HAS_AMX_BF16: "amx_bf16", CPU_HAS_AMX_INT8: "amx_int8"}
_FEATURE_CODES = {name: code for code, name in FEATURE_NAMES.items()}

# The table the other kernel modules call through (csrc/cpu_client.c).
_api = PyCapsule_New(<void*>cpu_api(), b"cext.cpu._api", NULL)


def features() -> tuple:
    """The features this CPU has and the OS allows ("avx2", "avx512", "avx512_vnni",
    "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_int8"), whatever the switch says."""
    found = cpu_features()
    return tuple(name for code, name in FEATURE_NAMES.items() if found & code)


def allows(str name) -> bool:
    """Whether kernels may use a feature now: the CPU has it and the switch's level allows it."""
    code = _FEATURE_CODES.get(name)
    if code is None:
        raise ValueError(f"feature: unknown {name!r}, expected one of {tuple(_FEATURE_CODES)}")
    return bool(cpu_allows(code))


def set_isa(str name) -> str:
    """"auto", "baseline", "avx2" or "avx512" -> the level now in use by every kernel module;
    ValueError if the CPU lacks it."""
    code = CPU_ISA_AUTO if name == "auto" else _ISA_CODES.get(name)
    if code is None:
        raise ValueError(f"isa: unknown {name!r}, expected 'auto' or one of {tuple(_ISA_CODES)}")
    result = cpu_set_isa(code)
    if result < 0:
        raise ValueError(f"isa: this CPU does not support {name!r}")
    return ISA_NAMES[result]


def get_isa() -> str:
    return ISA_NAMES[cpu_isa()]


def set_num_threads(int num_threads) -> int:
    """Threads of the kernels' pool, the caller included (clamped to 1..256)."""
    return cpu_set_num_threads(num_threads)


def get_num_threads() -> int:
    return cpu_num_threads()


def set_parallel_threshold(int64_t work):
    """Work (about multiply-adds) below which a call stays on the calling thread."""
    cpu_set_parallel_threshold(work)


def get_parallel_threshold() -> int:
    return cpu_parallel_threshold()


def set_spin_us(double us):
    """How long an idle worker polls for the next job (and the caller for its workers) before
    sleeping on a condition variable; 0 sleeps at once."""
    if not us >= 0:
        raise ValueError(f"spin_us: must be >= 0, got {us!r}")
    cpu_set_spin_ns(<int64_t>(us * 1000))


def get_spin_us() -> float:
    return cpu_get_spin_ns() / 1000.0


def read_bytes(intptr_t address, int64_t nbytes) -> int:
    """Reads the ``nbytes`` bytes at ``address`` on the kernels' pool, as a decode step reads its
    weights, with the GIL released, and returns the XOR of their 8-byte words (nbytes rounded
    down to 8): the probe of the memory's read bandwidth that benchmarks time
    (benchmarks.common.read_bandwidth)."""
    if nbytes < 0:
        raise ValueError(f"nbytes: must be >= 0, got {nbytes}")
    cdef uint64_t x
    with nogil:
        x = cpu_read_words(<const void*>address, nbytes)
    return x


cdef extern from "<time.h>" nogil:
    ctypedef long time_t
    cdef struct timespec:
        time_t tv_sec
        long tv_nsec
    int clock_gettime(int clk_id, timespec* tp)
    int CLOCK_MONOTONIC


cdef inline double _monotonic() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return ts.tv_sec + ts.tv_nsec * 1e-9


def busy_wait(double seconds):
    """Spin on this core for ``seconds`` with the GIL released, as a running kernel holds its
    core: a wait that ends on time, where a sleep on a virtual machine wakes ~0.1 ms late (and at
    times milliseconds). For engine.testing.ScriptedModel's paced forwards."""
    if not seconds >= 0:
        raise ValueError(f"seconds: must be >= 0, got {seconds!r}")
    cdef double deadline
    with nogil:
        deadline = _monotonic() + seconds
        while _monotonic() < deadline:
            pass
