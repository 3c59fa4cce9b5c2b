/* cpu.h's calls in a module other than cext.cpu: forwarded through the table cext.cpu exports,
 * bound by the module's .pyx at import (before any kernel runs). */
#include "cpu.h"

#include <stddef.h>

static const CpuApi *bound = NULL;

int cpu_client_bind(const void *api) {
    const CpuApi *table = (const CpuApi *)api;
    if (table == NULL || table->version != CPU_API_VERSION) return -1;
    bound = table;
    return 0;
}

uint32_t cpu_features(void) { return bound->features(); }
int cpu_isa(void) { return bound->isa(); }
int cpu_allows(uint32_t feature) { return bound->allows(feature); }
int cpu_num_threads(void) { return bound->num_threads(); }
int64_t cpu_parallel_threshold(void) { return bound->parallel_threshold(); }
float *cpu_scratch(size_t num_floats) { return bound->scratch(num_floats); }

int cpu_parallel_for(CpuRangeFn fn, const void *args, int64_t num_items, int64_t work, size_t scratch_floats) {
    return bound->parallel_for(fn, args, num_items, work, scratch_floats);
}
