# The CPU (cext/csrc/cpu.h): the feature probe, the instruction-set switch, the thread pool.
from libc.stdint cimport int64_t, uint32_t, uint64_t


cdef extern from "csrc/cpu.h" nogil:
    enum:
        CPU_ISA_AUTO
        CPU_ISA_BASELINE
        CPU_ISA_AVX2
        CPU_ISA_AVX512
        CPU_HAS_AVX2
        CPU_HAS_AVX512
        CPU_HAS_AVX512_VNNI
        CPU_HAS_AVX512_BF16
        CPU_HAS_AVX512_FP16
        CPU_HAS_AMX_BF16
        CPU_HAS_AMX_INT8

    ctypedef struct CpuApi:
        pass

    uint32_t cpu_features()
    int cpu_isa()
    int cpu_allows(uint32_t feature)
    int cpu_set_isa(int isa)
    int cpu_set_num_threads(int num_threads)
    int cpu_num_threads()
    void cpu_set_parallel_threshold(int64_t work)
    int64_t cpu_parallel_threshold()
    void cpu_set_spin_ns(int64_t ns)
    int64_t cpu_get_spin_ns()
    uint64_t cpu_read_words(const void *p, int64_t nbytes)
    const CpuApi* cpu_api()
