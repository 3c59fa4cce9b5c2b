/* Dispatch (instruction set chosen at first call), argument checks and a small thread pool
 * for the kernels of fused_impl.h. See fused_kernels.h for the contract. */
#include "fused_kernels.h"
#include "fk_pool.h"

#include <pthread.h>
#include <sched.h>
#include <time.h>
#include <stdint.h>
#include <stdlib.h>
#include <math.h>
#include <string.h>

#define FK_CHUNK 32         /* keys scored per step of the online softmax */
#define FK_SPAN 256         /* keys per online-softmax step of the 8-lane path (>= FK_CHUNK) */
#define FK_PREFETCH_KEYS 128 /* how far ahead the 8-lane path prefetches keys and values */


#define FK_CHUNK_COLS 512   /* columns of silu_mul converted per step */

typedef struct {
    float *resid; const void *delta; const void *weight; void *out;
    int64_t dim; float eps; int dtype;
} AddNormArgs;

typedef struct {
    void *qkv; int64_t row_stride; int num_heads, num_kv_heads, head_dim;
    const int64_t *positions; const float *cos, *sin; const int64_t *slots;
    void *k_cache, *v_cache; int dtype, cache_dtype;
} RopeArgs;

typedef struct {
    const void *q; int64_t q_row_stride; const void *k_cache, *v_cache; int block_size;
    const int64_t *block_tables; int64_t table_stride; const int64_t *context_lens;
    int num_heads, num_kv_heads, head_dim; int64_t sliding_window; float scale; void *out; int dtype, cache_dtype;
    int num_splits;   /* key ranges per (sequence, kv head); > 1: partials merged after */
    float *partials;  /* [B * KH * num_splits, G * (D + 2)] when num_splits > 1 */
} AttnArgs;

typedef struct {
    const void *gate_up; void *out; int64_t inter; int dtype;
} SiluArgs;

typedef struct {
    void (*add_rmsnorm)(const AddNormArgs *, int64_t, int64_t, float *);
    void (*rope_kv)(const RopeArgs *, int64_t, int64_t, float *);
    void (*attention)(const AttnArgs *, int64_t, int64_t, float *);
    void (*silu_mul)(const SiluArgs *, int64_t, int64_t, float *);
} KernelTable;

#define FK_SUFFIX baseline
#include "fused_impl.h"
#undef FK_SUFFIX

#if defined(__x86_64__) && defined(__GNUC__)
#define FK_HAVE_X86 1
#include <immintrin.h>
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define FK_SUFFIX avx2
#define FK_VEC8 1
#include "fused_impl.h"
#undef FK_VEC8
#undef FK_SUFFIX
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#define FK_SUFFIX avx512
#define FK_VEC8 1
#include "fused_impl.h"
#undef FK_VEC8
#undef FK_SUFFIX
#pragma GCC pop_options
#endif

/* ---- instruction set ---- */

static void kernel_store(int dtype, void *dst, const float *src, int64_t n) { store_row_baseline(dst, src, n, dtype); }

static const KernelTable *active_table = NULL;
static int active_isa = FK_ISA_BASELINE;

static int cpu_has(int isa) {
    if (isa == FK_ISA_BASELINE) return 1;
#ifdef FK_HAVE_X86
    __builtin_cpu_init();
    if (isa == FK_ISA_AVX2) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    if (isa == FK_ISA_AVX512)
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
#endif
    return 0;
}

int fk_set_isa(int isa) {
    if (isa == FK_ISA_AUTO) {
        isa = cpu_has(FK_ISA_AVX512) ? FK_ISA_AVX512 : cpu_has(FK_ISA_AVX2) ? FK_ISA_AVX2 : FK_ISA_BASELINE;
    }
    if (isa < FK_ISA_BASELINE || isa > FK_ISA_AVX512 || !cpu_has(isa)) return -1;
#ifdef FK_HAVE_X86
    active_table = isa == FK_ISA_AVX512 ? &kernel_table_avx512
                 : isa == FK_ISA_AVX2 ? &kernel_table_avx2 : &kernel_table_baseline;
#else
    active_table = &kernel_table_baseline;
#endif
    active_isa = isa;
    return isa;
}

int fk_get_isa(void) {
    if (active_table == NULL) fk_set_isa(FK_ISA_AUTO);
    return active_isa;
}

static const KernelTable *kernels(void) {
    if (active_table == NULL) fk_set_isa(FK_ISA_AUTO);
    return active_table;
}

/* ---- per-thread scratch ---- */

static __thread float *scratch_buf = NULL;
static __thread size_t scratch_len = 0;

static float *scratch(size_t num_floats) {
    if (num_floats > scratch_len) {
        float *grown = (float *)realloc(scratch_buf, num_floats * sizeof(float));
        if (grown == NULL) return NULL;
        scratch_buf = grown;
        scratch_len = num_floats;
    }
    return scratch_buf;
}

/* ---- thread pool ----
 * An idle worker polls for the next job for spin_ns (300 us by default), yielding the core to
 * any runnable thread between polls, then sleeps on a condition variable; the caller polls the
 * same way for its workers' chunks. Waking a sleeping vCPU costs tens of microseconds here, as
 * much as a whole decode-step product: with sleeping workers a second thread made SmolLM2's
 * batch-1 decode slower than one (57 vs 53 tok/s); polling workers and a 2^15 threshold made
 * it 87.5 (interleaved medians, load 1.4; scratch measurements quoted in the commit).
 * A job's items are claimed in chunks through one 64-bit word (generation << 32 | next item),
 * so a worker that wakes late, after the caller has taken every chunk, finds nothing and
 * never delays the caller; the caller waits only for chunks actually claimed. */

typedef void (*RangeFn)(const void *args, int64_t begin, int64_t end, float *scratch);

#define FK_MAX_THREADS 256

static struct {
    pthread_mutex_t mutex;
    pthread_cond_t work_ready, work_done;
    int num_threads;        /* wanted, caller included */
    int num_started;        /* workers running */
    int num_active;         /* workers 0..num_active-1 take part in the current job */
    uint32_t generation;    /* bumped per job */
    RangeFn fn; const void *args; int64_t num_items, chunk; size_t scratch_floats;
    uint64_t claim;         /* generation << 32 | next item */
    int64_t num_done;       /* items finished in the current job */
    int failed;
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER, 1, 0, 0, 0,
          NULL, NULL, 0, 1, 0, 0, 0, 0};

static int64_t parallel_threshold = 1 << 15;
static int64_t spin_ns = 300000;  /* how long an idle worker (and a waiting caller) polls before sleeping */

static inline int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* Polls until *word != value or spin_ns have passed; -> whether it changed. */
static int spin_while_equal32(const uint32_t *word, uint32_t value) {
    const int64_t budget = __atomic_load_n(&spin_ns, __ATOMIC_RELAXED);
    if (budget <= 0) return 0;
    const int64_t deadline = now_ns() + budget;
    for (;;) {
        for (int i = 0; i < 64; i++) {
            if (__atomic_load_n(word, __ATOMIC_ACQUIRE) != value) return 1;
            cpu_relax();
        }
        if (now_ns() > deadline) return 0;
        sched_yield();  /* a runnable thread (torch's team, a neighbour) gets the core first */
    }
}

static int spin_until_at_least(const int64_t *word, int64_t value) {
    const int64_t budget = __atomic_load_n(&spin_ns, __ATOMIC_RELAXED);
    if (budget <= 0) return 0;
    const int64_t deadline = now_ns() + budget;
    for (;;) {
        for (int i = 0; i < 64; i++) {
            if (__atomic_load_n(word, __ATOMIC_ACQUIRE) >= value) return 1;
            cpu_relax();
        }
        if (now_ns() > deadline) return 0;
        sched_yield();  /* a runnable thread (torch's team, a neighbour) gets the core first */
    }
}

typedef struct {
    uint32_t generation; RangeFn fn; const void *args; int64_t num_items, chunk; size_t scratch_floats;
} JobView;

/* Claims and runs chunks of the job `job` describes until none is left. */
static void run_chunks(const JobView *job) {
    float *buf = NULL;
    for (;;) {
        uint64_t seen = __atomic_load_n(&pool.claim, __ATOMIC_ACQUIRE);
        int64_t begin;
        do {
            if ((uint32_t)(seen >> 32) != job->generation) return;
            begin = (int64_t)(seen & 0xffffffffu);
            if (begin >= job->num_items) return;
        } while (!__atomic_compare_exchange_n(&pool.claim, &seen, seen + (uint64_t)job->chunk, 1,
                                              __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE));
        int64_t end = begin + job->chunk < job->num_items ? begin + job->chunk : job->num_items;
        if (buf == NULL) buf = scratch(job->scratch_floats);
        if (buf != NULL) {
            job->fn(job->args, begin, end, buf);
        } else {
            __atomic_store_n(&pool.failed, 1, __ATOMIC_RELAXED);
        }
        if (__atomic_add_fetch(&pool.num_done, end - begin, __ATOMIC_ACQ_REL) == job->num_items) {
            pthread_mutex_lock(&pool.mutex);
            pthread_cond_broadcast(&pool.work_done);
            pthread_mutex_unlock(&pool.mutex);
        }
    }
}

static void *worker_main(void *arg) {
    const int index = (int)(intptr_t)arg;
    pthread_mutex_lock(&pool.mutex);
    uint32_t seen = pool.generation;
    for (;;) {
        if (__atomic_load_n(&pool.generation, __ATOMIC_ACQUIRE) == seen) {
            pthread_mutex_unlock(&pool.mutex);
            spin_while_equal32(&pool.generation, seen);
            pthread_mutex_lock(&pool.mutex);
        }
        while (pool.generation == seen) pthread_cond_wait(&pool.work_ready, &pool.mutex);
        seen = pool.generation;
        JobView job = {pool.generation, pool.fn, pool.args, pool.num_items, pool.chunk, pool.scratch_floats};
        const int is_active = index < pool.num_active;
        pthread_mutex_unlock(&pool.mutex);
        if (is_active) run_chunks(&job);
        pthread_mutex_lock(&pool.mutex);
    }
    return NULL;
}

static void reset_after_fork(void) {
    /* The child has only the forking thread: forget the workers. */
    pthread_mutex_init(&pool.mutex, NULL);
    pthread_cond_init(&pool.work_ready, NULL);
    pthread_cond_init(&pool.work_done, NULL);
    pool.num_started = 0;
}

static int ensure_workers(int wanted) {
    static int is_atfork_set = 0;
    if (!is_atfork_set) {
        pthread_atfork(NULL, NULL, reset_after_fork);
        is_atfork_set = 1;
    }
    while (pool.num_started < wanted) {
        pthread_t thread;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int rc = pthread_create(&thread, &attr, worker_main, (void *)(intptr_t)pool.num_started);
        pthread_attr_destroy(&attr);
        if (rc != 0) break;
        pool.num_started++;
    }
    return pool.num_started;
}

/* Runs fn over [0, num_items): on the caller alone when the work is small or the pool has
 * one thread, else split in chunks claimed by the caller and the workers. Calls from
 * several Python threads at once are serialised by job_mutex. */
static pthread_mutex_t job_mutex = PTHREAD_MUTEX_INITIALIZER;

static int parallel_for(RangeFn fn, const void *args, int64_t num_items, int64_t work, size_t scratch_floats) {
    int num_threads = __atomic_load_n(&pool.num_threads, __ATOMIC_RELAXED);
    if (num_threads <= 1 || work < parallel_threshold || num_items < 2 || num_items > 0x7fffffff) {
        float *buf = scratch(scratch_floats);
        if (buf == NULL) return FK_NO_MEMORY;
        fn(args, 0, num_items, buf);
        return FK_OK;
    }
    pthread_mutex_lock(&job_mutex);
    pthread_mutex_lock(&pool.mutex);
    int num_workers = num_threads - 1;
    if ((int64_t)num_workers > num_items - 1) num_workers = (int)(num_items - 1);
    if (ensure_workers(num_workers) < num_workers) num_workers = pool.num_started;
    pool.num_active = num_workers;
    int64_t num_chunks = (int64_t)(num_workers + 1) * 4;
    JobView job = {pool.generation + 1, fn, args, num_items,
                   num_items / num_chunks > 0 ? num_items / num_chunks : 1, scratch_floats};
    pool.fn = fn;
    pool.args = args;
    pool.num_items = num_items;
    pool.chunk = job.chunk;
    pool.scratch_floats = scratch_floats;
    pool.failed = 0;
    __atomic_store_n(&pool.num_done, 0, __ATOMIC_RELEASE);
    __atomic_store_n(&pool.claim, (uint64_t)job.generation << 32, __ATOMIC_RELEASE);
    __atomic_store_n(&pool.generation, job.generation, __ATOMIC_RELEASE);  /* last: spinning workers read it unlocked */
    pthread_cond_broadcast(&pool.work_ready);
    pthread_mutex_unlock(&pool.mutex);
    run_chunks(&job);
    spin_until_at_least(&pool.num_done, num_items);
    pthread_mutex_lock(&pool.mutex);
    while (__atomic_load_n(&pool.num_done, __ATOMIC_ACQUIRE) < num_items)
        pthread_cond_wait(&pool.work_done, &pool.mutex);
    int failed = pool.failed;
    pthread_mutex_unlock(&pool.mutex);
    pthread_mutex_unlock(&job_mutex);
    return failed ? FK_NO_MEMORY : FK_OK;
}

int fk_parallel_for(FkRangeFn fn, const void *args, int64_t num_items, int64_t work, size_t scratch_floats) {
    return parallel_for(fn, args, num_items, work, scratch_floats);
}

int fk_use_avx2(void) { return fk_get_isa() >= FK_ISA_AVX2; }

int fk_set_num_threads(int num_threads) {
    if (num_threads < 1) num_threads = 1;
    if (num_threads > FK_MAX_THREADS) num_threads = FK_MAX_THREADS;
    __atomic_store_n(&pool.num_threads, num_threads, __ATOMIC_RELAXED);
    return num_threads;
}

int fk_get_num_threads(void) { return __atomic_load_n(&pool.num_threads, __ATOMIC_RELAXED); }
void fk_set_parallel_threshold(int64_t work) { parallel_threshold = work; }
int64_t fk_get_parallel_threshold(void) { return parallel_threshold; }
void fk_set_spin_ns(int64_t ns) { __atomic_store_n(&spin_ns, ns < 0 ? 0 : ns, __ATOMIC_RELAXED); }
int64_t fk_get_spin_ns(void) { return __atomic_load_n(&spin_ns, __ATOMIC_RELAXED); }

/* ---- entry points ---- */

static void add_rmsnorm_range(const void *a, int64_t b, int64_t e, float *s) { kernels()->add_rmsnorm(a, b, e, s); }
static void rope_kv_range(const void *a, int64_t b, int64_t e, float *s) { kernels()->rope_kv(a, b, e, s); }
static void attention_range(const void *a, int64_t b, int64_t e, float *s) { kernels()->attention(a, b, e, s); }
static void silu_mul_range(const void *a, int64_t b, int64_t e, float *s) { kernels()->silu_mul(a, b, e, s); }

int fk_add_rmsnorm(float *resid, const void *delta, const void *weight, void *out,
                   int64_t num_rows, int64_t dim, float eps, int dtype) {
    AddNormArgs args = {resid, delta, weight, out, dim, eps, dtype};
    return parallel_for(add_rmsnorm_range, &args, num_rows, num_rows * dim * 4, (size_t)dim * 2);
}

int fk_rope_kv_write(void *qkv, int64_t num_rows, int64_t row_stride, int num_heads, int num_kv_heads,
                     int head_dim, const int64_t *positions, const float *cos, const float *sin,
                     int64_t num_positions, const int64_t *slots, void *k_cache, void *v_cache,
                     int64_t num_slots, int dtype, int cache_dtype) {
    for (int64_t t = 0; t < num_rows; t++) {
        if (positions[t] < 0 || positions[t] >= num_positions) return FK_BAD_POSITION;
        if (slots[t] < 0 || slots[t] >= num_slots) return FK_BAD_SLOT;
    }
    RopeArgs args = {qkv, row_stride, num_heads, num_kv_heads, head_dim, positions, cos, sin, slots,
                     k_cache, v_cache, dtype, cache_dtype};
    int64_t work = num_rows * (num_heads + num_kv_heads) * head_dim * 4;
    return parallel_for(rope_kv_range, &args, num_rows, work, (size_t)head_dim * 2);
}

/* Combines the num_splits partial softmaxes of each (sequence, kv head) into out. */
static int merge_partials(const AttnArgs *a, int64_t num_pairs) {
    const int groups = a->num_heads / a->num_kv_heads, dim = a->head_dim, splits = a->num_splits;
    const size_t part_len = (size_t)groups * (dim + 2);
    const size_t esize = a->dtype == FK_FLOAT32 ? 4 : 2;
    float *row = scratch((size_t)dim);
    if (row == NULL) return FK_NO_MEMORY;
    for (int64_t pair = 0; pair < num_pairs; pair++) {
        const int64_t b = pair / a->num_kv_heads;
        const int kvh = (int)(pair % a->num_kv_heads);
        const float *parts = a->partials + (size_t)pair * splits * part_len;
        for (int g = 0; g < groups; g++) {
            float m = -1e30f;
            for (int s = 0; s < splits; s++) {
                float ms = parts[s * part_len + g];
                m = ms > m ? ms : m;
            }
            float total = 0.0f;
            for (int i = 0; i < dim; i++) row[i] = 0.0f;
            for (int s = 0; s < splits; s++) {
                const float *p = parts + s * part_len;
                float w = p[g] <= -1e30f ? 0.0f : expf(p[g] - m);
                total += w * p[groups + g];
                const float *acc = p + 2 * groups + (size_t)g * dim;
                for (int i = 0; i < dim; i++) row[i] += w * acc[i];
            }
            const float inv = 1.0f / total;
            for (int i = 0; i < dim; i++) row[i] *= inv;
            kernel_store(a->dtype, (char *)a->out + ((size_t)b * a->num_heads + (size_t)kvh * groups + g) * dim * esize,
                         row, dim);
        }
    }
    return FK_OK;
}

int fk_decode_attention(const void *q, int64_t q_row_stride, const void *k_cache, const void *v_cache,
                        int64_t num_blocks, int block_size, const int64_t *block_tables, int64_t table_stride,
                        const int64_t *context_lens, int num_seqs, int num_heads, int num_kv_heads,
                        int head_dim, int64_t sliding_window, float scale, void *out, int dtype,
                        int cache_dtype) {
    int64_t total_keys = 0;
    for (int b = 0; b < num_seqs; b++) {
        int64_t len = context_lens[b];
        if (len < 1 || (len + block_size - 1) / block_size > table_stride) return FK_BAD_LENGTH;
        int64_t first = sliding_window > 0 && len > sliding_window ? len - sliding_window : 0;
        const int64_t *table = block_tables + (int64_t)b * table_stride;
        for (int64_t j = first / block_size; j <= (len - 1) / block_size; j++) {
            if (table[j] < 0 || table[j] >= num_blocks) return FK_BAD_BLOCK;
        }
        total_keys += len - first;
    }
    int groups = num_heads / num_kv_heads;
    int64_t work = total_keys * num_heads * head_dim * 2;
    int64_t num_pairs = (int64_t)num_seqs * num_kv_heads;
    /* Few (sequence, kv head) pairs for the threads (batch 1, long context): split each
     * pair's keys too, so every thread gets a near-equal share (flash-decoding). */
    int num_threads = fk_get_num_threads();
    int num_splits = 1;
    if (num_threads > 1 && work >= parallel_threshold && num_pairs < 2 * num_threads) {
        num_splits = (int)((4 * num_threads + num_pairs - 1) / num_pairs);
        int64_t min_len = INT64_MAX;
        for (int b = 0; b < num_seqs; b++) {
            int64_t len = context_lens[b];
            if (sliding_window > 0 && len > sliding_window) len = sliding_window;
            if (len < min_len) min_len = len;
        }
        if (num_splits > min_len / FK_CHUNK) num_splits = (int)(min_len / FK_CHUNK);
        if (num_splits < 1) num_splits = 1;
    }
    float *partials = NULL;
    if (num_splits > 1) {
        partials = (float *)malloc(sizeof(float) * (size_t)num_pairs * num_splits * groups * (head_dim + 2));
        if (partials == NULL) return FK_NO_MEMORY;
    }
    AttnArgs args = {q, q_row_stride, k_cache, v_cache, block_size, block_tables, table_stride, context_lens,
                     num_heads, num_kv_heads, head_dim, sliding_window, scale, out, dtype, cache_dtype, num_splits,
                     partials};
    size_t floats = (size_t)groups * head_dim * 2 + (size_t)head_dim * 2 + (size_t)groups * FK_SPAN + 2 * (size_t)groups
                    + (size_t)groups * 64;  /* the 8-lane path's lane partials */
    int rc = parallel_for(attention_range, &args, num_pairs * num_splits, work, floats);
    if (rc == FK_OK && partials != NULL) rc = merge_partials(&args, num_pairs);
    free(partials);
    return rc;
}

int fk_silu_mul(const void *gate_up, void *out, int64_t num_rows, int64_t inter, int dtype) {
    SiluArgs args = {gate_up, out, inter, dtype};
    return parallel_for(silu_mul_range, &args, num_rows, num_rows * inter * 8, FK_CHUNK_COLS * 2);
}
