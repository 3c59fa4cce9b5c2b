/* The CPU, for every kernel file: one feature probe, one instruction-set switch, one thread pool.
 *
 * cpu.c (the cext.cpu module) owns them: CPUID plus XCR0 (what the OS saves on a context
 * switch) for the features, Linux's arch_prctl(ARCH_REQ_XCOMP_PERM) for AMX tile data, the
 * level the kernels dispatch on (CPU_ISA_*, forced lower with cpu_set_isa for tests), and the
 * pool. The other kernel modules (cext.ops, cext.qgemm, cext.sampler) compile cpu_client.c,
 * which forwards these same calls through the table cext.cpu exports as a capsule (bound when
 * the module is imported), so every module sees one switch and one pool.
 *
 * Kernel variants are compiled per function with target attributes or `#pragma GCC target`
 * (never -march=native) and chosen per call from cpu_isa() and cpu_features().
 */
#ifndef CPU_H
#define CPU_H

#include <stddef.h>
#include <stdint.h>

/* Levels, each including the ones below it. AVX2: avx2 + fma + f16c with the OS saving ymm.
 * AVX512: avx512 f/bw/vl/dq with the OS saving zmm and the mask registers. */
enum { CPU_ISA_AUTO = -1, CPU_ISA_BASELINE = 0, CPU_ISA_AVX2 = 1, CPU_ISA_AVX512 = 2 };

/* Feature bits of cpu_features(): what the CPU has and the OS allows (AMX: XCR0 bits 17 and 18
 * set and tile data permission granted to this process). */
enum {
    CPU_HAS_AVX2 = 1 << 0,        /* with fma and f16c */
    CPU_HAS_AVX512 = 1 << 1,      /* f, bw, vl, dq */
    CPU_HAS_AVX512_VNNI = 1 << 2, /* vpdpwssd / vpdpbusd */
    CPU_HAS_AVX512_BF16 = 1 << 3, /* vdpbf16ps, vcvtne2ps2bf16 */
    CPU_HAS_AVX512_FP16 = 1 << 4,
    CPU_HAS_AMX_BF16 = 1 << 5,    /* amx_tile + amx_bf16, usable */
    CPU_HAS_AMX_INT8 = 1 << 6,    /* amx_tile + amx_int8, usable */
};

/* Error codes shared by the kernel modules (0 = success). */
enum { CPU_OK = 0, CPU_NO_MEMORY = 5 };

typedef void (*CpuRangeFn)(const void *args, int64_t begin, int64_t end, float *scratch);

/* The CPU_HAS_* bits (probed once). */
uint32_t cpu_features(void);
/* The level the kernels run now: the best the CPU has unless cpu_set_isa chose a lower one. */
int cpu_isa(void);
/* Whether a feature may be used now: the CPU has it and the level allows it (the AVX-512 and
 * AMX features need CPU_ISA_AVX512). */
int cpu_allows(uint32_t feature);
/* Runs fn over [0, num_items): on the caller alone when `work` (about multiply-adds) is below
 * the parallel threshold or the pool has one thread, else in chunks claimed by the caller and
 * the pool's workers; each thread gets scratch_floats floats of scratch. CPU_OK or CPU_NO_MEMORY. */
int cpu_parallel_for(CpuRangeFn fn, const void *args, int64_t num_items, int64_t work, size_t scratch_floats);
int cpu_num_threads(void);
int64_t cpu_parallel_threshold(void);
/* The calling thread's scratch, grown to num_floats (NULL when out of memory). */
float *cpu_scratch(size_t num_floats);

/* cext.cpu only: the switch (-> the level now in use, or -1 if the CPU lacks it) and the pool's knobs. */
int cpu_set_isa(int isa);
int cpu_set_num_threads(int num_threads);
void cpu_set_parallel_threshold(int64_t work);
void cpu_set_spin_ns(int64_t ns);
int64_t cpu_get_spin_ns(void);
/* The XOR of the 8-byte words of [p, p + nbytes) (nbytes rounded down to 8), read by the pool's
 * threads in 64 KB pieces: what a probe of the memory's read bandwidth times. */
uint64_t cpu_read_words(const void *p, int64_t nbytes);

/* The table cext.cpu exports (capsule "cext.cpu._api") and cpu_client.c forwards through. */
#define CPU_API_VERSION 1
typedef struct {
    int version;
    uint32_t (*features)(void);
    int (*isa)(void);
    int (*allows)(uint32_t feature);
    int (*parallel_for)(CpuRangeFn fn, const void *args, int64_t num_items, int64_t work, size_t scratch_floats);
    int (*num_threads)(void);
    int64_t (*parallel_threshold)(void);
    float *(*scratch)(size_t num_floats);
} CpuApi;

const CpuApi *cpu_api(void);           /* cpu.c */
int cpu_client_bind(const void *api);  /* cpu_client.c: 0, or -1 for a table of another version */

#endif
