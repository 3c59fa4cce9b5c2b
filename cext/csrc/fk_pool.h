/* The fused kernels' thread pool, shared with the other C sources of the module
 * (defined in fused_kernels.c). */
#ifndef FK_POOL_H
#define FK_POOL_H

#include <stddef.h>
#include <stdint.h>

typedef void (*FkRangeFn)(const void *args, int64_t begin, int64_t end, float *scratch);

/* Runs fn over [0, num_items) on the pool (the caller alone below the parallel threshold
 * of `work`); each thread gets a scratch of scratch_floats floats. 0 or FK_NO_MEMORY. */
int fk_parallel_for(FkRangeFn fn, const void *args, int64_t num_items, int64_t work, size_t scratch_floats);

/* Whether the CPU (and the ISA chosen by fk_set_isa) allows the AVX2 kernels. */
int fk_use_avx2(void);

#endif
